"""The optional page checksum: sensitive to content, page order and page choice; off the loop."""

from __future__ import annotations

import torch

from pdserve.transport.checksum import page_checksum, page_checksum_off_loop


def test_page_checksum_sees_content_order_and_page_choice() -> None:
    kv = torch.randn(6, 2, 2, 4, 2, 8).to(torch.bfloat16)
    base = page_checksum(kv, [1, 2, 3])
    assert page_checksum(kv.clone(), [1, 2, 3]) == base
    assert page_checksum(kv, [2, 1, 3]) != base
    assert page_checksum(kv, [1, 2, 4]) != base
    kv[2, 0, 0, 0, 0, 0] += 1
    assert page_checksum(kv, [1, 2, 3]) != base
    assert 0 <= base < 1 << 63


async def test_page_checksum_off_loop_matches_and_keeps_the_callers_threads() -> None:
    kv = torch.randn(6, 2, 2, 4, 2, 8).to(torch.bfloat16)
    threads = torch.get_num_threads()
    assert await page_checksum_off_loop(kv, [3, 0, 5]) == page_checksum(kv, [3, 0, 5])
    assert torch.get_num_threads() == threads
