"""VRAM KV between two processes over real NIXL (runs where a CUDA device is present).

tests/transport/test_vram.py keeps both agents in one process, where UCX does not take its
cuda_ipc path; a PD pair on one GPU is two processes, and this is the transfer they make. If
registration fails with NIXL_ERR_BACKEND, nixl issue 1628's workaround points UCX_MODULE_DIR at
the UCX modules bundled in the nixl wheel.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.transport.procs import DriverProc

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


async def test_vram_pages_move_between_two_processes_and_bytes_match() -> None:
    sender, receiver = await asyncio.gather(
        DriverProc.spawn("sender", "prefill-0", device="cuda:0", hb=1.0),
        DriverProc.spawn("receiver", "decode-0", device="cuda:0", hb=1.0),
    )
    try:
        for room, scatter in (("contig", False), ("scatter", True)):
            assert (await sender.cmd("open", room=room))["ok"]
            reply = await receiver.cmd(
                "open", room=room, host="127.0.0.1", port=sender.port, num_pages=4
            )
            assert reply["ok"], reply
            sent = await sender.cmd(
                "send", room=room, num_pages=4, seed=11, token=7, scatter=scatter
            )
            assert sent["ok"]
            done = await receiver.wait_event("done", room=room, within_s=30.0)
            assert (done["state"], done["first_token"]) == ("Success", 7), done
            assert done["digest"] == sent["digest"]
    finally:
        await asyncio.gather(sender.close(), receiver.close())
