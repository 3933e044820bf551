"""CUDA KV pool sizing: the arithmetic on fake memory figures, and the warm-up batch."""

from __future__ import annotations

import pytest

from pdserve.kv_sizing import (
    DEFAULT_GRAPH_RESERVE_BYTES,
    DeviceMemory,
    graph_reserve,
    plan_kv_pages,
    warm_up_sequences,
)

GIB = 1 << 30
MIB = 1 << 20


def test_pages_are_what_the_share_leaves_after_weights_activations_and_graphs() -> None:
    memory = DeviceMemory(total_bytes=100 * GIB, free_at_start_bytes=99 * GIB)
    sizing = plan_kv_pages(memory, 0.9, weights_bytes=16 * GIB, activation_bytes=2 * GIB,
                           other_bytes=512 * MIB, graph_reserve_bytes=512 * MIB,
                           page_bytes=2 * MIB)  # fmt: skip
    assert sizing.share_bytes == 90 * GIB and not sizing.is_capped_by_free
    assert sizing.num_pages == (90 - 16 - 2 - 1) * GIB // (2 * MIB)
    assert sizing.kv_bytes == sizing.num_pages * 2 * MIB
    text = sizing.describe()
    assert "weights 16384" in text and "graphs 512 MiB" in text


def test_two_workers_split_one_gpu_and_the_second_is_capped_by_what_is_free() -> None:
    total = 100 * GIB
    first = plan_kv_pages(DeviceMemory(total, total), 0.45, 10 * GIB, GIB, 0, 0, MIB)
    # The second starts once the first holds its whole share.
    second = plan_kv_pages(DeviceMemory(total, total - 45 * GIB), 0.45, 10 * GIB, GIB, 0, 0, MIB)
    assert first.num_pages == second.num_pages == 34 * 1024
    # A third one would only get what is left, and says so.
    third = plan_kv_pages(DeviceMemory(total, total - 90 * GIB), 0.45, 5 * GIB, 0, 0, 0, MIB)
    assert third.is_capped_by_free and third.num_pages == 5 * 1024


def test_no_room_for_one_page_is_an_error_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        plan_kv_pages(DeviceMemory(10 * GIB, 10 * GIB), 0.5, 5 * GIB, 0, 0, 0, MIB)


def test_negative_other_memory_counts_as_none() -> None:
    # The driver can hand memory back between two readings; that is not room for more pages.
    sizing = plan_kv_pages(DeviceMemory(GIB, GIB), 1.0, 0, 0, -100 * MIB, 0, MIB)
    assert sizing.num_pages == 1024 and sizing.other_bytes == 0


def test_graph_reserve_is_zero_when_eager_else_the_configured_or_default_figure() -> None:
    assert graph_reserve(True, 123) == 0
    assert graph_reserve(False, None) == DEFAULT_GRAPH_RESERVE_BYTES
    assert graph_reserve(False, 7 * MIB) == 7 * MIB


def test_warm_up_covers_max_prefill_tokens_within_max_model_len() -> None:
    prefill, sampled = warm_up_sequences(
        max_prefill_tokens=1000, max_model_len=300, max_num_seqs=8, page_size=16, num_pages=100
    )
    assert [s.num_tokens for s in prefill] == [300] * 4  # ceil(1000 / 300) sequences
    pages = [p for s in prefill for p in s.page_ids]
    assert len(pages) == len(set(pages)) == 4 * 19 and max(pages) < 100
    assert len(sampled) == 8
    p = sampled[0].sampling
    assert p.logprobs and p.top_p < 1 and p.top_k > 0 and p.repetition_penalty != 1.0
