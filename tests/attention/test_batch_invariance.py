"""A query row's attention output has the same bits whatever else the call holds: a decode row
alone or among 8, and (C++ kernel) a prompt row whole, in a first chunk, in a later chunk or as
a decode step at its position, over a bf16 pool with float32 queries as CPU serving runs it."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.backend import AttentionConfig
from pdserve.attention.factory import create_backend
from pdserve.kernels import triton as triton_kernels
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool
from pdserve.kernels.paged_attention import load_kernel
from pdserve.model.forward_batch import decode_batch, extend_batch
from pdserve.sequence import Sequence

PAGE, NUM_KV, HEAD_DIM, GROUP = 4, 3, 64, 3
NUM_PAGES = 200
LENGTHS = [1, 3, 8, 17, 64, 5, 33, 100]


def _backends(device: str) -> list[str]:
    names = ["triton"] if triton_kernels.is_available(torch.device(device)) else []
    if device == "cpu" and load_kernel(torch.bfloat16, HEAD_DIM) is not None:
        names.append("cpp")
    return names


def _pool(device: str) -> KVPagePool:
    kv_config = KVCacheConfig(1, NUM_KV, HEAD_DIM, NUM_PAGES, PAGE, torch.bfloat16)
    pool = KVPagePool(kv_config, device=device, hugepages=False)
    gen = torch.Generator().manual_seed(1)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(torch.bfloat16))
    return pool


def _seqs() -> list[Sequence]:
    seqs, first = [], 0
    for i, n in enumerate(LENGTHS):
        pages = list(range(first, first + -(-n // PAGE)))
        first += len(pages)
        seqs.append(Sequence(f"s{i}", [0] * n, n, page_ids=pages, num_cached_tokens=n - 1))
    return seqs


def test_a_decode_row_has_the_same_bits_alone_and_among_eight(device: str) -> None:
    for name in _backends(device):
        backend_dtype = torch.float32 if name == "cpp" else torch.bfloat16
        config = AttentionConfig(GROUP * NUM_KV, NUM_KV, HEAD_DIM, None, 128, backend_dtype)
        pool = _pool(device)
        backend = create_backend(name, config, pool)
        seqs = _seqs()
        gen = torch.Generator().manual_seed(2)
        q = torch.randn(len(seqs), GROUP * NUM_KV, HEAD_DIM, generator=gen).to(backend_dtype)
        q = q.to(device)
        # Each row's new K/V: stored again, with the same values, by the calls alone.
        kv = torch.randn(len(seqs), 2, NUM_KV, HEAD_DIM, generator=gen).to(backend_dtype)
        kv = kv.to(device)
        batch = decode_batch(seqs, PAGE, pool.scratch_page, torch.device(device))
        backend.init_forward_metadata(batch)
        together = backend.forward_decode(0, q, kv, batch)
        for i, s in enumerate(seqs):
            one = decode_batch([s], PAGE, pool.scratch_page, torch.device(device))
            backend.init_forward_metadata(one)
            alone = backend.forward_decode(0, q[i : i + 1], kv[i : i + 1], one)
            assert torch.equal(alone[0], together[i]), (name, i)


@pytest.mark.parametrize("group", [1, 3, 4, 7])  # query heads per KV head: passes of 1-4 heads
@pytest.mark.parametrize("chunk", [1, 7, 16, 60])
def test_cpp_prompt_rows_equal_decode_rows_whatever_the_chunking(chunk: int, group: int) -> None:
    """A 60-token prompt's rows computed in chunks of ``chunk`` (each over the K/V the earlier
    chunks stored) equal its rows computed whole, and each equals a decode step at its
    position, bit for bit."""
    if load_kernel(torch.bfloat16, HEAD_DIM) is None:
        pytest.skip("the C++ CPU kernels do not run here")
    n = 60
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(n, group * NUM_KV, HEAD_DIM, generator=gen)
    kv = torch.randn(n, 2, NUM_KV, HEAD_DIM, generator=gen)
    config = AttentionConfig(group * NUM_KV, NUM_KV, HEAD_DIM, None, 128, torch.float32)

    def rows_in_chunks(size: int) -> torch.Tensor:
        pool = KVPagePool(KVCacheConfig(1, NUM_KV, HEAD_DIM, NUM_PAGES, PAGE, torch.bfloat16),
                          hugepages=False)  # fmt: skip
        backend = create_backend("cpp", config, pool)
        out = []
        for start in range(0, n, size):
            end = min(n, start + size)
            seq = Sequence("p", [0] * end, end, page_ids=list(range(-(-n // PAGE))),
                           num_cached_tokens=start)  # fmt: skip
            batch, _ = extend_batch([seq], PAGE, pool.scratch_page, torch.device("cpu"))
            backend.init_forward_metadata(batch)
            out.append(backend.forward_extend(0, q[start:end], kv[start:end], batch))
        return torch.cat(out)

    whole = rows_in_chunks(n)
    assert torch.equal(rows_in_chunks(chunk), whole)
    pool = KVPagePool(KVCacheConfig(1, NUM_KV, HEAD_DIM, NUM_PAGES, PAGE, torch.bfloat16),
                      hugepages=False)  # fmt: skip
    backend = create_backend("cpp", config, pool)
    # Each row as a decode step at its position: every step stores its own K/V first.
    for pos in range(n):
        seq = Sequence("p", [0] * (pos + 1), pos + 1, page_ids=list(range(-(-n // PAGE))),
                       num_cached_tokens=pos)  # fmt: skip
        batch = decode_batch([seq], PAGE, pool.scratch_page, torch.device("cpu"))
        backend.init_forward_metadata(batch)
        row = backend.forward_decode(0, q[pos : pos + 1], kv[pos : pos + 1], batch)
        assert torch.equal(row[0], whole[pos]), pos
