"""DecodeGraphRunner's bookkeeping, run eagerly: buckets, scratch-page padding, refilled inputs.

On a CPU the graphs are never captured, but every step goes through the same static buffers
as a replay would; each step must give the eager runner's logits and write the same pages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.kernels import triton as triton_kernels
from pdserve.model.graph_runner import DecodeGraphRunner, batch_buckets
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sequence import Sequence
from tests.conftest import DEVICES
from tests.model.checkpoints import write_checkpoint

PAGE_SIZE, MAX_SEQS = 4, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(
    scope="module",
    params=[(b, d) for b in ("auto", "triton") for d in DEVICES],
    ids=[f"{b}-{d}" for b in ("auto", "triton") for d in DEVICES],
)
def runner(request: pytest.FixtureRequest, checkpoint: Path) -> ModelRunner:
    """The runner on each device (module scope: it cannot use the ``device`` fixture)."""
    backend, device = request.param
    if backend == "triton" and not triton_kernels.is_available(torch.device(device)):
        pytest.skip(f"Triton does not run on {device} here")
    config = RunnerConfig(
        str(checkpoint), dtype="float32", page_size=PAGE_SIZE, num_pages=96,
        max_num_seqs=MAX_SEQS, attention_backend=backend, device=device,
    )  # fmt: skip
    return ModelRunner(config)


def _graph_runner(runner: ModelRunner, use_graphs: bool = False) -> DecodeGraphRunner:
    graphs = DecodeGraphRunner(
        runner.model, runner.attn_backend, MAX_SEQS, runner.max_model_len, use_graphs
    )
    graphs.capture()
    return graphs


def _prefilled(runner: ModelRunner, lens: list[int], first_page: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(sum(lens))
    vocab = runner.model_config.vocab_size
    seqs = [
        Sequence(f"s{i}", torch.randint(0, vocab, (n,), generator=gen).tolist(), n,
                 page_ids=list(range(first_page + 8 * i, first_page + 8 * i + 8)))
        for i, n in enumerate(lens)
    ]  # fmt: skip
    runner.prefill_logits(seqs)
    for s in seqs:
        s.num_cached_tokens = s.num_tokens
        s.token_ids.append(1)
    return seqs


def test_buckets_are_powers_of_two_then_steps_up_to_the_limit() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]


def test_bucket_is_the_smallest_that_holds_the_batch(runner: ModelRunner) -> None:
    graphs = _graph_runner(runner)
    assert [graphs.bucket_for(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    for bad in (0, MAX_SEQS + 1):
        assert not graphs.can_run(bad)
        with pytest.raises(ValueError):
            graphs.bucket_for(bad)


def test_graphs_need_cuda_and_a_capturable_backend(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        pytest.skip("CUDA graphs can run here")
    assert runner.graph_runner is None and runner.graph_memory_bytes == 0
    with pytest.raises(ValueError, match="CUDA graphs"):
        DecodeGraphRunner(runner.model, runner.attn_backend, MAX_SEQS, 64, use_graphs=True)


def test_cuda_graph_replays_equal_eager_steps(runner: ModelRunner) -> None:
    if runner.device.type != "cuda":
        pytest.skip("needs a GPU")
    assert runner.graph_runner is not None and runner.graph_memory_bytes > 0
    graphs, eager = _graph_runner(runner, use_graphs=True), _graph_runner(runner)
    for lens, first_page in [([5, 17, 9], 0), ([2, 3], 40), ([4] * 5, 48)]:
        seqs = _prefilled(runner, lens, first_page)
        want = runner.model.logits(eager.run(seqs)[1])
        got = runner.model.logits(graphs.run(seqs)[1])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_padded_steps_equal_eager_decode_and_padding_lands_on_the_scratch_page(
    runner: ModelRunner,
) -> None:
    graphs = _graph_runner(runner)
    pool = runner.kv_pool
    # 3 sequences: bucket 4, one padded row; then 2 shorter ones: the wider table and the
    # padded row of the step before must not leak into this one; then 5 (bucket 8).
    for step, (lens, first_page) in enumerate([([5, 17, 9], 0), ([2, 3], 40), ([4] * 5, 48)]):
        seqs = _prefilled(runner, lens, first_page)
        before = pool.storage.clone()
        want = runner.decode_logits(seqs)
        want_kv = pool.kv.clone()
        pool.storage.copy_(before)
        pool.storage[pool.scratch_page] = 0
        _, hidden = graphs.run(seqs)
        assert hidden.shape[0] == len(seqs), "outputs are sliced back to the real rows"
        torch.testing.assert_close(runner.model.logits(hidden), want, atol=1e-5, rtol=0)
        # The same K/V (up to the GEMM's rounding at another row count), and no other page
        # than the sequences' own and the scratch page written.
        torch.testing.assert_close(pool.kv, want_kv, atol=1e-5, rtol=0)
        owned = torch.tensor([p for s in seqs for p in s.page_ids], device=pool.kv.device)
        untouched = torch.ones(pool.kv.shape[0], dtype=torch.bool, device=pool.kv.device)
        untouched[owned] = False
        assert torch.equal(pool.kv[untouched], before[: pool.kv.shape[0]][untouched]), step
        padded = graphs.bucket_for(len(seqs)) > len(seqs)
        assert bool(pool.storage[pool.scratch_page].abs().sum() > 0) == padded
