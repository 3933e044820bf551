"""The same tokens at every TP size: TP2 (and TP4) rank processes give the bits TP1 gives.

Real rank processes (``python -m pdserve.parallel.rank_main``) over a gloo group: each case
runs one workload (a batch of two prompts, one over a cached prefix, then decode steps, then a
mixed step of a prompt chunk and decode rows) at TP1 and at TP t, and every logit must be
equal, not close: the row-parallel sums add their fixed segments in one tree at every size.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from pdserve.model.demo import DemoShape, write_demo_model
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.parallel.row_parallel import RowParallelLinear
from pdserve.parallel.vocab_parallel import VocabParallelHead
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence
from tests.model.checkpoints import write_checkpoint
from tests.model.gguf.writer import write_gguf

pytestmark = pytest.mark.slow

PAGE = 4
# logits, sampled tokens with logprobs, the KV pool's pages
Outcome = tuple[torch.Tensor, list[object], torch.Tensor]


def _seq(name: str, ids: list[int], pages: list[int], cached: int = 0) -> Sequence:
    # seeded sampling at temperature 0.8: the sampled tokens depend on every logit's bits
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=7, logprobs=True, top_logprobs=3)
    return Sequence(name, ids, len(ids), sampling, pages, num_cached_tokens=cached)


def _workload(runner: ModelRunner, vocab: int) -> tuple[torch.Tensor, list[object]]:
    """Every logit of prefill (fresh and over a cached prefix) and decode steps, and the
    sampled tokens and logprobs of mixed steps (prompt chunks beside decode rows)."""
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (37, 21, 9)]
    a, b = _seq("a", ids[0], list(range(0, 40))), _seq("b", ids[1], list(range(40, 80)))
    logits = [runner.prefill_logits([a, b])]
    last = logits[0]
    # c's first 12 tokens are a's: their K/V already sit in a's first 3 pages (a cache hit)
    c = _seq("c", ids[0][:12] + ids[2], a.page_ids[:3] + list(range(80, 120)), cached=12)
    logits.append(runner.prefill_logits([c]))
    sampled: list[object] = []
    for step in range(5):
        for s, row in zip((a, b), last, strict=True):
            s.num_cached_tokens = s.num_tokens
            s.token_ids.append(int(row.argmax()))
        if step < 4:
            last = runner.decode_logits([a, b])
            logits.append(last)
    d = _seq("d", ids[2] * 3, list(range(120, 160)))
    for _ in range(3):  # d's prompt in chunks, a and b decoding beside it
        d.num_cached_tokens = min(d.num_cached_tokens, d.num_tokens - 1)
        out = runner.mixed([d], [a, b])
        sampled.append((out.token_ids, out.logprobs))
        for s, tok in zip((d, a, b), out.token_ids, strict=True):
            s.num_cached_tokens = s.num_tokens
            s.token_ids.append(tok)
    return torch.cat([t.reshape(-1) for t in logits]), sampled


def _run(path: Path, tp: int, dtype: str = "float32") -> Outcome:
    config = RunnerConfig(
        str(path), dtype=dtype, page_size=PAGE, num_pages=160, tensor_parallel_size=tp
    )
    runner = ModelRunner(config)
    try:
        if tp > 1:
            assert any(isinstance(layer.down, RowParallelLinear) for layer in runner.model.layers)
            assert isinstance(runner.model.lm_head, VocabParallelHead)
            # the shared files left /dev/shm once every rank mapped them (a kill leaks none)
            assert runner._ranks is not None
            assert not os.path.exists(runner._ranks.launch.kv_path)
        logits, sampled = _workload(runner, runner.model_config.vocab_size)
        # the engine pool: every rank's heads, as the transport sees it
        return logits, sampled, runner.kv_pool.kv.clone()
    finally:
        runner.close()


def _checkpoint(name: str, root: Path) -> Path:
    if name.startswith("gguf"):
        demo = write_demo_model(root / "demo", DemoShape(num_layers=2, max_corpus_bytes=200_000))
        q = GGMLQuantizationType
        types = {"attn_v.weight": q.Q5_0, "ffn_down.weight": q.Q8_0, "attn_output.weight": q.Q5_0}
        return write_gguf(demo, root / "demo.Q8_0.gguf", q.Q8_0, types=types)
    return write_checkpoint(root, name, sharded=False)


def _assert_same(tp1: Outcome, tp_n: Outcome) -> None:
    assert torch.equal(tp1[0], tp_n[0]), (tp1[0] - tp_n[0]).abs().max()
    assert tp1[1] == tp_n[1]  # sampled tokens and their logprobs, exactly
    assert torch.equal(tp1[2], tp_n[2])  # every KV page, bit for bit: what a transfer moves


CASES = ["llama", "qwen2", "qwen3", "mistral", "qwen2_odd_vocab", "gguf-mixed"]


@pytest.mark.parametrize("name", CASES)
def test_tp2_gives_tp1_s_logits_bit_for_bit(name: str, tmp_path: Path) -> None:
    path = _checkpoint(name, tmp_path)
    _assert_same(_run(path, 1), _run(path, 2))


def test_bf16_weights_give_tp1_s_logits_at_tp2(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "qwen2", sharded=False)
    _assert_same(_run(path, 1, "bfloat16"), _run(path, 2, "bfloat16"))


def test_tp4_with_replicated_kv_heads_gives_tp1_s_logits(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "qwen2_odd_vocab", sharded=False)  # 4 heads, 2 KV heads
    _assert_same(_run(path, 1), _run(path, 4))


def test_a_tp_size_the_model_does_not_split_into_is_refused_by_name(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "llama", sharded=False)  # 4 heads
    config = RunnerConfig(str(path), dtype="float32", num_pages=16, tensor_parallel_size=8)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 does not split"):
        ModelRunner(config)
