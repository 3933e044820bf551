"""The sender's write path: one task per room, from its KV being ready to its last chunk DONE.

Each chunk is one NIXL WRITE with its ``DataNotifMsg`` attached, so the receiver's signal can
never overtake the data. No WRITE is posted before the room's :class:`KVReady` marker completed
(the prefill forward that wrote the pages is done on the device). A room's *write window* is
open from :meth:`RoomWriter.begin` until its task ends (the readiness wait and delay faults sit
inside it); the sender's aborts and page releases wait for it (``on_window_closed``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdserve.fsm import BEGIN_TRANSFER, CHUNK_SENT, TRANSFER_DONE, Room
from pdserve.kernels.kv_ready import ALWAYS_READY, KVReady, wait_kv_ready
from pdserve.transport.agent_config import TransferError
from pdserve.transport.checksum import page_checksum_off_loop
from pdserve.transport.messages import DataNotifMsg
from pdserve.transport.observer import TransferObserver
from pdserve.transport.sender_state import SenderState
from pdserve.transport.wire import encode

logger = logging.getLogger(__name__)


def pages_to_write(room: Room) -> list[int]:
    """The room's source pages less the leading ones the decode holds cached (its
    ``RoomMsg.num_cached_pages``): only these are written, into the decode's posted pages."""
    return room.page_ids[room.data.get("skip", 0) :]


class RoomWriter:
    """Writes the rooms of one sender's :class:`SenderState` (its table, agent and counters).

    ``on_window_closed(room)`` runs when a room's write window closes (the sender releases what
    waited for it); ``lose_peer(key, reason)`` when a write failed for its decode peer.
    """

    def __init__(
        self,
        state: SenderState,
        observer: TransferObserver,
        on_window_closed: Callable[[Room], None],
        lose_peer: Callable[[str, str], None],
    ) -> None:
        self.state = state
        self.observer = observer
        self.writes = state.writes  # rooms whose write window is open
        self._on_window_closed = on_window_closed
        self._lose_peer = lose_peer

    def begin(self, room: Room) -> None:
        """Both ends are there (pages to send, destination pages): start the room's transfer."""
        s = self.state
        src, dst = pages_to_write(room), room.data["dst"]
        if not src:
            s.table.fail(
                room.room_id,
                f"transfer_error: decode holds {room.data['skip']} of {len(room.page_ids)} "
                "pages cached, nothing left to send",
            )
            return
        if len(src) > len(dst):
            s.table.fail(
                room.room_id, f"transfer_error: {len(src)} pages to send, decode posted {len(dst)}"
            )
            return
        if s.table.fire(room.room_id, BEGIN_TRANSFER):
            room.data["writing"] = True  # the write window opens now, before any await
            room.data["registration"] = s.peers.by_key(room.peer or "")
            self.writes[(room.peer, room.data["nonce"])] = room
            counters = s.counters
            counters.peak_writes_outstanding = max(
                counters.peak_writes_outstanding, len(self.writes)
            )
            s.spawn(self._transfer(room), f"kv-send-{room.room_id}")

    async def _transfer(self, room: Room) -> None:
        s = self.state
        write_key = (room.peer, room.data["nonce"])
        try:
            started = await self._kv_ready(room)
            if started is None:
                return
            await self._write_chunks(room)
            if not room.is_terminal:
                s.fire(room, TRANSFER_DONE)
                self._record_success(room, started)
        except TransferError as e:
            s.counters.transfer_errors += 1
            logger.warning("room=%s req=%s transfer failed: %s", room.room_id, room.request_id, e)
            # Only the registration this write went to is suspect: a late error (the write
            # outlived a loss) must not take down a re-registration of the same peer.
            registration = room.data.get("registration")
            if registration is not None and s.peers.by_key(registration.key) is registration:
                self._lose_peer(registration.key, f"transfer_error: {e}")
            else:
                s.fail_if_live(room, f"transfer_error: {e}")
        except ValueError as e:  # bad page lists: this room's problem, not the peer's
            s.counters.transfer_errors += 1
            s.fail_if_live(room, f"transfer_error: {e}")
        finally:
            self.writes.pop(write_key, None)
            room.data["writing"] = False
            self._on_window_closed(room)

    async def _kv_ready(self, room: Room) -> float | None:
        """Wait (polling, bounded) until the forward that wrote the room's pages is done on the
        device: the loop time it was seen done, or None when the room ended meanwhile or failed
        for it (``transfer_error: kv not ready``)."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        marker: KVReady = room.data.get("kv_ready", ALWAYS_READY)
        timeout_s = self.state.config.kv_ready_timeout_s
        if await wait_kv_ready(marker, timeout_s, lambda: room.is_terminal):
            now = loop.time()
            self.observer.on_kv_ready_wait(now - asked)
            return None if room.is_terminal else now
        if not room.is_terminal:
            self.state.counters.kv_not_ready += 1
            self.state.fail_if_live(room, f"transfer_error: kv not ready after {timeout_s:.1f}s")
        return None

    async def _write_chunks(self, room: Room) -> None:
        s = self.state
        faults = s.faults
        src = pages_to_write(room)
        dst = room.data["dst"][: len(src)]
        step = s.config.max_chunk_pages or len(src)
        bounds = list(range(0, len(src), step))
        for chunk, lo in enumerate(bounds):
            delay = faults.chunk_delay_s() if faults is not None else 0.0
            if delay:
                await asyncio.sleep(delay)  # injected fault: widens the write window
            is_last = chunk == len(bounds) - 1
            hi = lo + step
            notif = await self._data_notif(room, chunk, is_last, min(hi, len(src)))
            if room.is_terminal:  # aborted between chunks: the rest is never written
                return
            if faults is not None and faults.should_fail_transfer():
                raise TransferError("fault injection: transfer failed")
            await s.agent.write(room.data["agent"], src[lo:hi], dst[lo:hi], encode(notif))
            s.counters.chunks_sent += 1
            s.counters.bytes_sent += len(src[lo:hi]) * s.pool.page_bytes
            if not is_last:
                s.fire(room, CHUNK_SENT)

    async def _data_notif(
        self, room: Room, chunk: int, is_last: bool, num_pages: int
    ) -> DataNotifMsg:
        s = self.state
        checksum = None
        if is_last and s.config.checksum:
            checksum = await page_checksum_off_loop(s.pool.kv, pages_to_write(room))
        return DataNotifMsg(
            room_id=room.room_id,
            nonce=room.data["nonce"],
            incarnation=s.config.incarnation,
            chunk=chunk,
            is_last=is_last,
            num_pages=num_pages,
            first_token=room.data["first_token"] if is_last else None,
            checksum=checksum,
            first_logprob=room.data["first_logprob"] if is_last else None,
            first_top_logprobs=room.data["first_top_logprobs"] if is_last else (),
        )

    def _record_success(self, room: Room, started: float) -> None:
        s = self.state
        s.counters.rooms_sent += 1
        seconds = asyncio.get_running_loop().time() - started
        self.observer.on_room_sent(seconds, len(pages_to_write(room)) * s.pool.page_bytes)
        peer, faults = room.peer, s.faults
        if peer is not None and faults is not None and faults.should_drop_peer(peer):
            self._lose_peer(peer, "peer_lost: fault injection")
