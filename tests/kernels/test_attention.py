"""Paged attention kernels against a dense reference written the obvious way."""

from __future__ import annotations

import torch

from pdserve.kernels.attention import (
    PrefillSeqMeta,
    additive_mask,
    decode_attention,
    decode_key_mask,
    gather_pages,
    prefill_attention,
    write_kv,
    write_layer_kv,
)

HEADS, KV_HEADS, DIM, PAGE = 4, 2, 8, 4


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window=None):
    """Dense attention of queries at ``q_pos`` over keys 0..len(k)-1, GQA by repetition."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM**-0.5
    k_pos = torch.arange(k.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _caches(num_pages: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(num_pages, PAGE, KV_HEADS, DIM), torch.zeros(num_pages, PAGE, KV_HEADS, DIM)


def _store(kc, vc, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    pos = torch.arange(k.shape[0])
    write_kv(kc, vc, torch.tensor(pages)[pos // PAGE], pos % PAGE, k, v)


def test_write_kv_places_tokens_by_page_table() -> None:
    kc, vc = _caches()
    k = torch.randn(6, KV_HEADS, DIM)
    _store(kc, vc, [7, 2], k, -k)
    assert torch.equal(kc[7], k[:4]) and torch.equal(kc[2, :2], k[4:])
    assert torch.equal(vc[2, :2], -k[4:]) and not kc[2, 2:].any()


def test_packed_prefill_with_and_without_cached_prefix_matches_dense() -> None:
    torch.manual_seed(0)
    kc, vc = _caches()
    # seq A: 5 fresh tokens on pages [3, 9]; seq B: 6 cached + 3 new tokens on pages [1, 4, 12].
    ka, va = torch.randn(5, KV_HEADS, DIM), torch.randn(5, KV_HEADS, DIM)
    kb, vb = torch.randn(9, KV_HEADS, DIM), torch.randn(9, KV_HEADS, DIM)
    _store(kc, vc, [1, 4, 12], kb[:6], vb[:6])
    q = torch.randn(8, HEADS, DIM)
    k_new, v_new = torch.cat([ka, kb[6:]]), torch.cat([va, vb[6:]])
    pos_new = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8])
    pages = torch.tensor([3, 9, 1, 4, 12])
    slot_pages = torch.tensor([3, 3, 3, 3, 9, 4, 4, 12])
    write_kv(kc, vc, slot_pages, pos_new % PAGE, k_new, v_new)
    seqs = [
        PrefillSeqMeta(q_start=0, num_new=5, num_cached=0, page_ids=pages[:2]),
        PrefillSeqMeta(q_start=5, num_new=3, num_cached=6, page_ids=pages[2:]),
    ]
    out = prefill_attention(q, k_new, v_new, seqs, kc, vc, DIM**-0.5)
    torch.testing.assert_close(out[:5], _reference(q[:5], ka, va, torch.arange(5)))
    torch.testing.assert_close(out[5:], _reference(q[5:], kb, vb, torch.arange(6, 9)))


def test_prefill_sliding_window_hides_old_keys() -> None:
    torch.manual_seed(1)
    kc, vc = _caches()
    k, v, q = (
        torch.randn(11, KV_HEADS, DIM),
        torch.randn(11, KV_HEADS, DIM),
        torch.randn(11, HEADS, DIM),
    )
    _store(kc, vc, [0, 1, 2], k, v)
    seqs = [PrefillSeqMeta(0, 11, 0, torch.tensor([0, 1, 2]))]
    out = prefill_attention(q, k, v, seqs, kc, vc, DIM**-0.5, sliding_window=3)
    torch.testing.assert_close(out, _reference(q, k, v, torch.arange(11), window=3))


def test_batched_decode_over_ragged_page_tables_matches_dense() -> None:
    torch.manual_seed(2)
    kc, vc = _caches()
    lens = [1, 4, 5, 11]
    tables = [[5], [6, 0], [7, 8], [9, 10, 11]]
    keys = [torch.randn(n, KV_HEADS, DIM) for n in lens]
    values = [torch.randn(n, KV_HEADS, DIM) for n in lens]
    for t, k, v in zip(tables, keys, values, strict=True):
        _store(kc, vc, t, k, v)
    q = torch.randn(4, HEADS, DIM)
    block_table = torch.tensor([t + [0] * (3 - len(t)) for t in tables])
    mask = decode_key_mask(torch.tensor(lens), 3 * PAGE)
    keys, values = gather_pages(kc, block_table), gather_pages(vc, block_table)
    out = decode_attention(q, keys, values, mask, DIM**-0.5)
    for i, n in enumerate(lens):
        ref = _reference(q[i : i + 1], keys[i], values[i], torch.tensor([n - 1]))
        torch.testing.assert_close(out[i : i + 1], ref)


def test_decode_key_mask_with_sliding_window() -> None:
    mask = decode_key_mask(torch.tensor([2, 6]), 8, sliding_window=3)
    assert mask.int().tolist() == [[1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0, 0]]


def test_additive_mask_gives_the_same_decode_as_the_boolean_mask() -> None:
    torch.manual_seed(3)
    kc, vc = _caches()
    kc.normal_()
    vc.normal_()
    q = torch.randn(2, HEADS, DIM)
    block_table = torch.tensor([[1, 2], [3, 4]])
    mask = decode_key_mask(torch.tensor([5, 8]), 2 * PAGE)
    keys, values = gather_pages(kc, block_table), gather_pages(vc, block_table)
    expected = decode_attention(q, keys, values, mask, DIM**-0.5)
    got = decode_attention(q, keys, values, additive_mask(mask, q.dtype), DIM**-0.5)
    torch.testing.assert_close(got, expected)
    assert additive_mask(mask, torch.float32)[0].tolist()[4:] == [0.0] + [float("-inf")] * 3


def test_write_layer_kv_places_k_and_v_like_two_writes() -> None:
    torch.manual_seed(4)
    layer_pool = torch.zeros(16, 2, PAGE, KV_HEADS, DIM)  # (pages, K/V, page_size, Hkv, D)
    kv = torch.randn(3, 2, KV_HEADS, DIM)
    pages, offsets = torch.tensor([7, 7, 2]), torch.tensor([0, 3, 1])
    write_layer_kv(layer_pool, pages, offsets, kv)
    kc, vc = _caches()
    write_kv(kc, vc, pages, offsets, kv[:, 0], kv[:, 1])
    assert torch.equal(layer_pool[:, 0], kc) and torch.equal(layer_pool[:, 1], vc)


def test_chunks_over_a_cached_prefix_match_dense_with_and_without_a_window() -> None:
    # Each query of a 7-token chunk after 13 cached tokens, without a window, with one that
    # cuts into the prefix, and with one longer than the sequence.
    torch.manual_seed(4)
    kc, vc = _caches()
    k, v = torch.randn(20, KV_HEADS, DIM), torch.randn(20, KV_HEADS, DIM)
    pages = [11, 2, 7, 5, 0]
    _store(kc, vc, pages, k, v)
    q = torch.randn(7, HEADS, DIM)
    seqs = [PrefillSeqMeta(0, 7, 13, torch.tensor(pages))]
    for window in (None, 5, 64):
        out = prefill_attention(q, k[13:], v[13:], seqs, kc, vc, DIM**-0.5, window)
        want = _reference(q, k, v, torch.arange(13, 20), window=window)
        torch.testing.assert_close(out, want, msg=f"window {window}")


def test_a_chunk_over_a_cached_prefix_is_bit_identical_to_the_whole_prompts_rows() -> None:
    # What keeps greedy output identical with the prefix cache and chunking on or off: the
    # rows of the second chunk equal, bit for bit, those rows of a whole-prompt prefill.
    torch.manual_seed(5)
    kc, vc = _caches()
    kc, vc = kc.bfloat16(), vc.bfloat16()
    n, cut = 19, 11
    q = torch.randn(n, HEADS, DIM).bfloat16()
    k, v = torch.randn(n, KV_HEADS, DIM).bfloat16(), torch.randn(n, KV_HEADS, DIM).bfloat16()
    pages = [3, 8, 1, 14, 6]
    _store(kc, vc, pages, k, v)
    whole = prefill_attention(q, k, v, [PrefillSeqMeta(0, n, 0, torch.tensor(pages))], kc, vc,
                              DIM**-0.5)  # fmt: skip
    chunk = PrefillSeqMeta(0, n - cut, cut, torch.tensor(pages))
    second = prefill_attention(q[cut:], k[cut:], v[cut:], [chunk], kc, vc, DIM**-0.5)
    assert torch.equal(second, whole[cut:])
