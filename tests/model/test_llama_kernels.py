"""The decode fast path (paged C++ attention, fused add + RMSNorm) equals the torch path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.attention.torch_backend import TorchAttentionBackend
from pdserve.kernels import rmsnorm
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence
from tests.model.checkpoints import write_checkpoint

NUM_STEPS = 24
PROMPT_LENS = [5, 17, 33, 8]  # ragged: the torch path needs its key mask, the kernel does not


def _decode(
    runner: ModelRunner, num_steps: int, forced: list[list[int]] | None = None
) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill a ragged batch, then decode greedily (or feed the ``forced`` continuations);
    every sequence's tokens and each step's logits ``(steps, B, vocab)``."""
    vocab = runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    seqs = [
        Sequence(f"s{i}", torch.randint(0, vocab, (n,), generator=gen).tolist(), n,
                 SamplingParams(temperature=0), list(range(16 * i, 16 * (i + 1))))
        for i, n in enumerate(PROMPT_LENS)
    ]  # fmt: skip
    steps = [runner.prefill_logits(seqs)]
    for _ in range(num_steps):
        for i, s in enumerate(seqs):
            s.num_cached_tokens = s.num_tokens
            token = forced[i][s.num_tokens] if forced else int(steps[-1][i].argmax())
            s.token_ids.append(token)
        steps.append(runner.decode_logits(seqs))
    return [s.token_ids for s in seqs], torch.stack(steps)


def _torch_path(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    torch_backend = TorchAttentionBackend(runner.attn_backend.config, runner.kv_pool)
    monkeypatch.setattr(runner, "attn_backend", torch_backend)
    monkeypatch.setattr(rmsnorm, "_kernel_for", lambda x, weight: None)


def _kernel_runner(model_dir: Path, dtype: str) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(str(model_dir), dtype=dtype, page_size=4, num_pages=64))
    if runner.attn_backend.name != "cpp":
        pytest.skip("the C++ kernels do not run here")
    return runner


def _assert_float32_paths_agree(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _kernel_runner(model_dir, "float32")
    fast_tokens, fast_logits = _decode(runner, NUM_STEPS)
    _torch_path(runner, monkeypatch)
    torch_tokens, torch_logits = _decode(runner, NUM_STEPS)
    assert fast_tokens == torch_tokens
    torch.testing.assert_close(fast_logits, torch_logits, atol=1e-4, rtol=0)


def test_demo_model_greedy_tokens_equal_on_both_paths(
    demo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _assert_float32_paths_agree(demo_dir, monkeypatch)


def test_demo_model_bfloat16_logits_agree_on_both_paths(
    demo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 rounds differently on the two paths (the kernel rounds once, SDPA more often), so
    a random model's near-ties can flip greedy picks: both paths are fed the same tokens."""
    runner = _kernel_runner(demo_dir, "bfloat16")
    tokens, fast_logits = _decode(runner, NUM_STEPS)
    _torch_path(runner, monkeypatch)
    _, torch_logits = _decode(runner, NUM_STEPS, forced=tokens)
    scale = torch_logits.abs().max().item()
    torch.testing.assert_close(fast_logits, torch_logits, atol=0.03 * scale, rtol=0)
    # Same top token wherever the torch path's pick is not a near-tie.
    top2 = torch_logits.topk(2, dim=-1).values
    is_clear = top2[..., 0] - top2[..., 1] > 0.02 * scale
    assert is_clear.sum() > is_clear.numel() // 2
    assert torch.equal(fast_logits.argmax(-1)[is_clear], torch_logits.argmax(-1)[is_clear])


def test_sliding_window_model_decodes_the_same_on_both_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mistral (window 24): contexts grow past the window while decoding."""
    _assert_float32_paths_agree(write_checkpoint(tmp_path / "mistral", "mistral"), monkeypatch)
