"""Every attention backend against the torch reference, through the one interface.

The same calls (an extend over a cached prefix, then decode steps) run on a fresh pool per
backend with the same inputs: outputs and the K/V each backend stores must equal the torch
backend's, and nothing may be written outside the sequences' slots.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.backend import AttentionBackend, AttentionConfig
from pdserve.attention.factory import create_backend
from pdserve.kernels import triton as triton_kernels
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool
from pdserve.kernels.paged_attention import load_kernel
from pdserve.model.forward_batch import ForwardBatch, decode_batch, extend_batch, mixed_batch
from pdserve.sequence import Sequence

PAGE, NUM_LAYERS, NUM_KV, HEAD_DIM, GROUP = 4, 2, 2, 64, 4
NUM_PAGES = 40
PREFIX = [0, 6, 0]  # cached tokens before the extend
PROMPTS = [9, 11, 4]  # total tokens after it
NUM_DECODE_STEPS = 3


def _backends(device: str) -> list[str]:
    """The backends other than torch that run on ``device`` here."""
    names = ["triton"] if triton_kernels.is_available(torch.device(device)) else []
    if device == "cpu" and load_kernel(torch.float32, HEAD_DIM) is not None:
        names.append("cpp")
    return names


def _run(
    name: str, device: str, dtype: torch.dtype, window: int | None,
    kv_dtype: torch.dtype | None = None,
) -> tuple[list[list[torch.Tensor]], KVPagePool]:  # fmt: skip
    """Outputs of every call, and the pool, after one extend and a few decode steps; ``dtype``
    is the activations' (q and the new K/V), ``kv_dtype`` the cache's (default: the same)."""
    config = AttentionConfig(GROUP * NUM_KV, NUM_KV, HEAD_DIM, window, 64, act_dtype=dtype)
    kv_dtype = kv_dtype or dtype
    kv_config = KVCacheConfig(NUM_LAYERS, NUM_KV, HEAD_DIM, NUM_PAGES, PAGE, kv_dtype)
    pool = KVPagePool(kv_config, device=device, hugepages=False)
    backend = create_backend(name, config, pool)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(NUM_PAGES, generator=gen).tolist()  # scattered pages
    seqs = [
        Sequence(f"s{i}", list(range(n)), n, page_ids=order[8 * i : 8 * i + 8],
                 num_cached_tokens=PREFIX[i])
        for i, n in enumerate(PROMPTS)
    ]  # fmt: skip
    # The prefixes' K/V: written straight into the pool (as a transfer or an earlier step would).
    for s in seqs:
        for p in s.page_ids[: -(-s.num_cached_tokens // PAGE)]:
            pool.kv[p] = torch.randn(pool.kv[p].shape, generator=gen).to(kv_dtype)
    outputs = []
    batch, _ = extend_batch(seqs, PAGE, pool.scratch_page, torch.device(device))
    outputs.append(_forward(backend, batch, gen, dtype, device))
    for _ in range(NUM_DECODE_STEPS):
        for s in seqs:
            s.num_cached_tokens = s.num_tokens
            s.token_ids.append(0)
        batch = decode_batch(seqs, PAGE, pool.scratch_page, torch.device(device))
        outputs.append(_forward(backend, batch, gen, dtype, device))
    return outputs, pool


def _forward(
    backend: AttentionBackend,
    batch: ForwardBatch,
    gen: torch.Generator,
    dtype: torch.dtype,
    device: str,
) -> list[torch.Tensor]:
    backend.init_forward_metadata(batch)
    out = []
    num_tokens = batch.input_ids.shape[0]
    for layer in range(NUM_LAYERS):
        qkv = torch.randn(num_tokens, (GROUP + 2) * NUM_KV, HEAD_DIM, generator=gen).to(dtype)
        qkv = qkv.to(device)
        q, new_kv = qkv[:, : GROUP * NUM_KV], qkv[:, GROUP * NUM_KV :].unflatten(1, (2, NUM_KV))
        out.append(backend.forward(layer, q, new_kv, batch).float().cpu())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_backends_match_the_torch_backend(
    device: str, dtype: torch.dtype, window: int | None
) -> None:
    ref_out, ref_pool = _run("torch", device, dtype, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name in _backends(device):
        out, pool = _run(name, device, dtype, window)
        for got, want in zip(out, ref_out, strict=True):
            torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=name)
        assert torch.equal(pool.storage, ref_pool.storage), name


@pytest.mark.parametrize("window", [None, 5])
def test_float32_activations_over_a_bf16_cache_match_the_torch_backend(
    device: str, window: int | None
) -> None:
    """``--dtype float32 --kv-cache-dtype bfloat16``: the new K/V are rounded to the cache's
    dtype as they are stored and attended as stored, in every backend (the Triton backend
    wrote them uncast and crashed, issue 31)."""
    ref_out, ref_pool = _run("torch", device, torch.float32, window, torch.bfloat16)
    assert ref_pool.storage.dtype == torch.bfloat16
    for name in _backends(device):
        out, pool = _run(name, device, torch.float32, window, torch.bfloat16)
        for got, want in zip(out, ref_out, strict=True):
            # The PV product rounds the probabilities to the cache's dtype, as flash
            # attention does; the torch reference keeps them float32.
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=name)
        assert torch.equal(pool.storage, ref_pool.storage), name


def test_no_backend_writes_the_scratch_page_for_real_rows(device: str) -> None:
    for name in ["torch", *_backends(device)]:
        _, pool = _run(name, device, torch.float32, None)
        assert pool.storage[pool.scratch_page].abs().sum() == 0, name


def _mixed_vs_apart(name: str, device: str, dtype: torch.dtype, window: int | None) -> None:
    """One mixed forward (two prompt chunks, then three decode rows) against the extend part
    and the decode part run alone on a copy of the pool, with the same q and K/V rows."""
    config = AttentionConfig(GROUP * NUM_KV, NUM_KV, HEAD_DIM, window, max_model_len=64)
    kv_config = KVCacheConfig(NUM_LAYERS, NUM_KV, HEAD_DIM, NUM_PAGES, PAGE, dtype)
    pools = [KVPagePool(kv_config, device=device, hugepages=False) for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    order = torch.randperm(NUM_PAGES, generator=gen).tolist()
    # (tokens, cached): chunks of 5 over 6 cached and of 7 over none; decode rows at 3, 9, 13.
    shapes = [(11, 6), (7, 0), (3, 2), (9, 8), (13, 12)]
    seqs = [
        Sequence(f"s{i}", list(range(n)), n, page_ids=order[4 * i : 4 * i + 4],
                 num_cached_tokens=c)
        for i, (n, c) in enumerate(shapes)
    ]  # fmt: skip
    for s in seqs:
        for p in s.page_ids:
            page = torch.randn(pools[0].kv[p].shape, generator=gen).to(dtype)
            for pool in pools:
                pool.kv[p] = page
    prefill, decode = seqs[:2], seqs[2:]
    dev = torch.device(device)
    mixed, rows = mixed_batch(prefill, decode, PAGE, pools[0].scratch_page, dev)
    extend, last = extend_batch(prefill, PAGE, pools[1].scratch_page, dev)
    dec = decode_batch(decode, PAGE, pools[1].scratch_page, dev)
    assert rows.tolist() == [*last.tolist(), 12, 13, 14]
    together = create_backend(name, config, pools[0])
    apart = create_backend(name, config, pools[1])
    together.init_forward_metadata(mixed)
    outs = []
    for layer in range(NUM_LAYERS):
        qkv = torch.randn(15, (GROUP + 2) * NUM_KV, HEAD_DIM, generator=gen).to(dtype).to(device)
        q, new_kv = qkv[:, : GROUP * NUM_KV], qkv[:, GROUP * NUM_KV :].unflatten(1, (2, NUM_KV))
        outs.append((together.forward(layer, q, new_kv, mixed), q, new_kv))
    apart.init_forward_metadata(extend)
    for layer, (_, q, new_kv) in enumerate(outs):
        outs[layer] += (apart.forward(layer, q[:12], new_kv[:12], extend),)
    apart.init_forward_metadata(dec)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for layer, (got, q, new_kv, ext_out) in enumerate(outs):
        want = torch.cat([ext_out, apart.forward(layer, q[12:], new_kv[12:], dec)])
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=name)
    assert torch.equal(pools[0].storage, pools[1].storage), name


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_gives_its_chunks_and_decode_rows_what_each_part_gives_alone(
    device: str, dtype: torch.dtype, window: int | None
) -> None:
    for name in ["torch", *_backends(device)]:
        _mixed_vs_apart(name, device, dtype, window)
