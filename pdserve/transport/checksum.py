"""Optional page checksum of a room's KV (``TransportConfig.checksum``): sender attaches, receiver
verifies before Success."""

from __future__ import annotations

import asyncio

import torch

_CHECKSUM_MASK = (1 << 63) - 1


def page_checksum(kv: torch.Tensor, page_ids: list[int]) -> int:
    """Order-sensitive checksum of pages ``page_ids`` of a page-major KV tensor (vectorized).

    Per-page sums of the pages' 32-bit (or 16-bit) words, weighted by the page's position in the
    list, so a wrong page, a swapped pair or garbage all change it. Fits the wire's 63 bits.
    """
    idx = torch.tensor(page_ids, dtype=torch.long, device=kv.device)
    flat = kv.index_select(0, idx).reshape(len(page_ids), -1).view(torch.uint8)
    word = torch.int32 if flat.shape[1] % 4 == 0 else torch.int16
    sums = flat.view(word).sum(dim=1, dtype=torch.int64)
    weights = torch.arange(1, len(page_ids) + 1, dtype=torch.int64, device=kv.device) * 0x9E3779B1
    return int((sums * weights).sum().item()) & _CHECKSUM_MASK


async def page_checksum_off_loop(kv: torch.Tensor, page_ids: list[int]) -> int:
    """:func:`page_checksum` on an executor thread (torch releases the GIL), on one torch thread
    there: a second OpenMP thread team in the process would slow every model step (see
    pdserve/engine/runner_thread.py)."""

    def one_thread() -> int:
        torch.set_num_threads(1)  # this thread's own OpenMP setting; the runner's is unchanged
        return page_checksum(kv, page_ids)

    return await asyncio.to_thread(one_thread)
