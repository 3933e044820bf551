"""Offline generation: the `pdserve generate` entry point and the LLM over the engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pdserve.generate import main
from pdserve.llm import LLM, generate
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from tests.model.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(RunnerConfig(str(model_dir), dtype="float32", page_size=4, num_pages=64))


def test_json_output_has_prompt_ids_generated_ids_and_text(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(model_dir), "--prompt", "The quick", "--prompt-ids", "5,6,7"]
    assert main([*argv, "--max-tokens", "5", "--ignore-eos", "--json", "--dtype", "float32"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[1]["prompt_token_ids"] == [5, 6, 7]
    assert all(len(r["token_ids"]) == 5 and r["finish_reason"] == "length" for r in rows)
    runner = ModelRunner(RunnerConfig(str(model_dir), dtype="float32", num_pages=16))
    assert rows[0]["prompt_token_ids"] == runner.tokenizer.encode("The quick")
    full = runner.tokenizer.decode(rows[0]["token_ids"])
    # Like the server, a trailing incomplete UTF-8 character is not emitted.
    assert full.startswith(rows[0]["text"]) and set(full[len(rows[0]["text"]) :]) <= {"\ufffd"}


def test_no_prompt_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--max-tokens", "3"]) == 2
    assert "--prompt" in capsys.readouterr().err


def test_batched_generation_equals_one_at_a_time(runner: ModelRunner) -> None:
    prompts = [[3, 4, 5], [9], list(range(10, 27))]
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=42, ignore_eos=True)
    together = [r.token_ids for r in generate(runner, prompts, sampling)]
    alone = [generate(runner, [p], sampling)[0].token_ids for p in prompts]
    assert together == alone and all(len(t) == 6 for t in together)


def test_stop_token_ends_generation_without_its_text(runner: ModelRunner) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [free] = generate(runner, [[1, 2, 3]], greedy)
    stop_at = free.token_ids[3]
    greedy.stop_token_ids = [stop_at]
    [stopped] = generate(runner, [[1, 2, 3]], greedy)
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_at)


def test_generation_stops_at_max_model_len(model_dir: Path) -> None:
    small = ModelRunner(
        RunnerConfig(str(model_dir), dtype="float32", page_size=4, num_pages=64, max_model_len=12)
    )
    [result] = generate(small, [list(range(1, 9))], SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(result.token_ids) == 4 and result.finish_reason == "length"


def test_llm_reuses_the_prefix_of_an_earlier_call_with_the_same_tokens(runner: ModelRunner) -> None:
    prompt = list(range(3, 23))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(runner) as llm:
        [first] = llm.generate([prompt], greedy)
        [again] = llm.generate([prompt[:18] + [40]], greedy)
        [same] = llm.generate([prompt], greedy)
    assert (first.num_cached_tokens, again.num_cached_tokens, same.num_cached_tokens) == (0, 16, 16)
    assert same.token_ids == first.token_ids


def test_generate_is_callable_from_inside_a_running_event_loop(runner: ModelRunner) -> None:
    async def caller():  # noqa: ANN202
        return generate(runner, [[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]

    result = asyncio.run(caller())
    assert len(result.token_ids) == 3


def test_agenerate_is_awaitable_from_another_event_loop(runner: ModelRunner) -> None:
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with LLM(runner) as llm:
        sync = llm.generate([[5, 6, 7], [8, 9]], sampling)
        together = asyncio.run(llm.agenerate([[5, 6, 7], [8, 9]], sampling))
    assert [r.token_ids for r in together] == [r.token_ids for r in sync]


def test_generate_takes_the_same_device_flags_as_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.generate import _parse_args  # noqa: PLC0415

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    args = _parse_args(["--prompt", "x", "--device", "cuda:1", "--gpu-memory-utilization", "0.3"])
    assert (args.device, args.gpu_memory_utilization, args.kv_cache_mb) == ("cuda:1", 0.3, None)
    with pytest.raises(SystemExit):
        _parse_args(["--prompt", "x", "--device", "cuda:2"])  # no such device
