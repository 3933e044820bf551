"""Offline generation at TP > 1: ``pdserve generate -tp 2`` and an ``LLM`` over a TP2 runner give
TP1's tokens and text; closing ends the rank processes; a rank's death fails the engine's calls
with the cause named, never a hang. Real rank processes on the demo model (4 heads, 2 KV heads)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.engine.protocol import EngineError
from pdserve.llm import LLM, GenerationResult
from pdserve.model.demo import write_demo_model
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GENERATE_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 30.0
SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True),
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"))


def _generate_cli(model: Path, tp: int, *sampling: str) -> list[dict[str, object]]:
    argv = ["generate", "--model", str(model), "--prompt", "Hello there", "--prompt", "a",
            "--prompt-ids", ",".join(str(i) for i in range(5, 45)), "--max-tokens", "8",
            "--ignore-eos", "--json", "--kv-cache-mb", "16", "--tensor-parallel-size", str(tp),
            *sampling]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", *argv],
        capture_output=True, text=True, timeout=GENERATE_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize(
    "sampling", [(), ("--temperature", "0.8", "--seed", "5")], ids=["greedy", "seeded"]
)
def test_generate_at_tp2_prints_tp1_s_tokens_and_text(demo: Path, sampling: tuple[str]) -> None:
    tp1 = _generate_cli(demo, 1, *sampling)
    assert len(tp1) == 3 and all(len(r["token_ids"]) == 8 for r in tp1)  # type: ignore[arg-type]
    assert _generate_cli(demo, 2, *sampling) == tp1


def _runner(model: Path, tp: int) -> ModelRunner:
    config = RunnerConfig(str(model), page_size=4, num_pages=256, tensor_parallel_size=tp)
    return ModelRunner(config)


def _prompts() -> list[list[int]]:
    # mixed lengths (one over several pages, one of a single token), two sharing a prefix
    lengths = [1, 3, 7, 12, 19, 26, 33, 40]
    return [[(7 * i + 3 * j) % 4000 + 2 for j in range(n)] for i, n in enumerate(lengths)]


def _offline(runner: ModelRunner) -> dict[str, list[GenerationResult]]:
    with LLM(runner) as llm:
        return {name: llm.generate(_prompts(), s) for name, s in SAMPLINGS.items()}


def _wait_gone(pids: list[int], timeout_s: float = EXIT_TIMEOUT_S) -> list[int]:
    """The pids still alive after waiting up to ``timeout_s`` for them to exit."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _is_alive(pid)]
        if alive:
            time.sleep(0.05)  # poll interval of a bounded wait
    return alive


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_llm_over_a_tp2_runner_gives_tp1_s_results_and_close_ends_its_ranks(demo: Path) -> None:
    tp1 = _offline(_runner(demo, 1))
    runner = _runner(demo, 2)
    pids = runner._ranks.pids if runner._ranks is not None else []
    assert len(pids) == 1 and all(_is_alive(pid) for pid in pids)
    assert _offline(runner) == tp1  # tokens, text, finish reasons and cached prompt tokens
    assert all(len(r.token_ids) == 8 for results in tp1.values() for r in results)
    assert _wait_gone(pids) == [] and runner._ranks is None


def test_a_killed_rank_fails_the_llm_s_calls_naming_it_and_close_still_ends(demo: Path) -> None:
    runner = _runner(demo, 2)
    assert runner._ranks is not None
    [rank1] = runner._ranks.pids
    llm = LLM(runner)
    try:
        [ok] = llm.generate([[5, 6, 7]], SAMPLINGS["greedy"])
        assert len(ok.token_ids) == 8
        os.kill(rank1, signal.SIGKILL)
        with pytest.raises(EngineError, match=r"tensor-parallel rank 1 exited \(status -9\)"):
            llm.generate([[5, 6, 7]], SAMPLINGS["greedy"])
        with pytest.raises(EngineError, match="engine failed: tensor-parallel rank 1") as later:
            llm.generate([[8, 9]], SAMPLINGS["greedy"])
        assert later.value.code == "engine_failed"
        assert not llm.engine.is_ready()
    finally:
        llm.close()
    assert runner._ranks is None and _wait_gone([rank1]) == []
