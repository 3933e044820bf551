"""The decoder against the `transformers` reference, in-process, for every architecture."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.kernels import cpu_ext
from pdserve.kernels import triton as triton_kernels
from pdserve.llm import generate
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence
from tests.conftest import DEVICES
from tests.model.checkpoints import load_reference, write_checkpoint

NUM_DECODE_STEPS = 32
PAGE_SIZE = 4

# (architecture, sharded checkpoint?)
CASES = [
    ("llama", False),
    ("llama3_rope", True),
    ("llama_linear_rope", False),
    ("mistral", True),
    ("qwen2", False),
    ("qwen3", True),
]


@dataclass
class Case:
    name: str
    device: str
    path: Path
    reference: Any
    runner: ModelRunner


@pytest.fixture(
    scope="module",
    params=[(c, d) for c in CASES for d in DEVICES],
    ids=[f"{c[0]}-{d}" for c in CASES for d in DEVICES],
)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    """One architecture on one device (a module-scoped fixture cannot use ``device``)."""
    (name, sharded), device = request.param
    path = write_checkpoint(tmp_path_factory.mktemp(name), name, sharded=sharded)
    runner = ModelRunner(
        RunnerConfig(str(path), dtype="float32", page_size=PAGE_SIZE, num_pages=64, device=device)
    )
    return Case(name, device, path, load_reference(path), runner)


def _prompt(length: int, vocab: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def _greedy_logits(runner: ModelRunner, prompt: list[int], num_steps: int) -> torch.Tensor:
    """Prefill then ``num_steps`` greedy decode steps; logits of every step, stacked."""
    seq = Sequence("s", list(prompt), len(prompt), page_ids=list(range(32)))
    steps = [runner.prefill_logits([seq])[0]]
    for _ in range(num_steps):
        seq.num_cached_tokens = seq.num_tokens
        seq.token_ids.append(int(steps[-1].argmax()))
        steps.append(runner.decode_logits([seq])[0])
    return torch.stack(steps).cpu(), seq.token_ids


def test_prefill_and_decode_logits_match_transformers(case: Case) -> None:
    prompt = _prompt(21, case.runner.model_config.vocab_size)
    ours, tokens = _greedy_logits(case.runner, prompt, NUM_DECODE_STEPS)
    with torch.no_grad():
        ref = case.reference(torch.tensor([tokens])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(ours, ref[: NUM_DECODE_STEPS + 1], atol=2e-4, rtol=1e-4)


def test_greedy_generation_is_token_identical_to_transformers_generate(case: Case) -> None:
    prompt = _prompt(13, case.runner.model_config.vocab_size, seed=1)
    sampling = SamplingParams(max_tokens=NUM_DECODE_STEPS, temperature=0.0, ignore_eos=True)
    [ours] = generate(case.runner, [prompt], sampling)
    case.reference.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = case.reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=NUM_DECODE_STEPS
        )
    assert ours.token_ids == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_cuda_code_path_matches_transformers_on_cpu(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a CUDA device runs: the Triton attention backend (its interpreter here) and torch
    for everything else, every C++ kernel off. Mistral's window is passed while decoding."""
    if not triton_kernels.is_available(torch.device("cpu")):
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: a GPU machine)")
    monkeypatch.setattr(cpu_ext, "load", lambda: None)
    path = write_checkpoint(tmp_path / name, name)
    config = RunnerConfig(str(path), dtype="float32", page_size=PAGE_SIZE, num_pages=64,
                          attention_backend="triton")  # fmt: skip
    runner = ModelRunner(config)
    assert runner.attn_backend.name == "triton"
    prompt = _prompt(21, runner.model_config.vocab_size)
    num_steps = 8
    ours, tokens = _greedy_logits(runner, prompt, num_steps)
    with torch.no_grad():
        ref = load_reference(path)(torch.tensor([tokens])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(ours, ref[: num_steps + 1], atol=2e-4, rtol=1e-4)


def test_bfloat16_logits_track_transformers_bfloat16(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "llama", "llama")
    runner = ModelRunner(
        RunnerConfig(str(path), dtype="bfloat16", page_size=PAGE_SIZE, num_pages=64)
    )
    prompt = _prompt(21, runner.model_config.vocab_size)
    ours, tokens = _greedy_logits(runner, prompt, 8)
    reference = load_reference(path, torch.bfloat16)
    with torch.no_grad():
        ref = reference(torch.tensor([tokens])).logits[0, len(prompt) - 1 :].float()
    scale = ref.abs().max()
    assert (ours - ref[:9]).abs().max() < 0.03 * scale
