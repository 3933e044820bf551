"""KV hand-off between the engine and the transport, one class per disaggregated role.

The engine calls four hooks (admit, on_prefilled, on_finish, on_pages_freed); everything about
rooms lives here, so the scheduler and the engine loop stay role-agnostic.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any

from pdserve.engine.handoff_host import HandoffHost
from pdserve.engine.protocol import EngineError, TokenLogprob
from pdserve.engine.request import Request, RequestState
from pdserve.engine.scheduler import insert_by_priority
from pdserve.fsm import DuplicateRoomError, Room, RoomOutcome, RoomState
from pdserve.kernels.kv_ready import ALWAYS_READY, KVReady

if TYPE_CHECKING:  # not loaded for the colocated role and the offline API (no NIXL there)
    from pdserve.transport import KVReceiver, KVSender

logger = logging.getLogger(__name__)


def error_for_room(outcome: RoomOutcome) -> EngineError:
    """Map a failed room's reason to the error the client sees."""
    reason = outcome.reason or "unknown"
    if reason.startswith("timeout"):
        return EngineError(f"KV transfer timed out ({reason})", 504, "timeout", reason.split()[0])
    code = reason.split(":")[0].strip() or "kv_transfer_failed"
    return EngineError(f"KV transfer failed: {reason}", 503, "service_unavailable", code)


def _require_room(req: Request) -> str:
    if req.kv_transfer is None:
        raise EngineError(
            "this is a disaggregated worker: requests need kv_transfer_params (send them "
            "through the pdserve router)",
            400, "invalid_request_error", "missing_kv_transfer_params",
        )  # fmt: skip
    return req.kv_transfer.room_id


def _first_logprob(room: Room) -> TokenLogprob | None:
    lp = room.data.get("first_logprob")
    if lp is None:
        return None
    return TokenLogprob(int(room.data["first_token"]), lp, tuple(room.data["first_top_logprobs"]))


def _duplicate(room_id: str) -> EngineError:
    return EngineError(f"room {room_id!r} is already live", 409, "conflict_error", "duplicate_room")


class Handoff:
    def __init__(self, engine: HandoffHost) -> None:
        self.engine = engine

    def admit(self, req: Request) -> None:
        raise NotImplementedError

    def on_prefilled(
        self,
        req: Request,
        first_token: int,
        logprob: TokenLogprob | None,
        kv_ready: KVReady = ALWAYS_READY,
    ) -> bool:
        """Return True when the hand-off takes the request after its prefill. ``kv_ready``
        completes once the prefill's KV writes are done on the device."""
        return False

    def on_finish(self, req: Request, prev: RequestState, reason: str) -> None:
        pass

    def on_pages_freed(self) -> None:
        pass

    def debug_rooms(self) -> list[dict[str, Any]]:
        return []


class PrefillHandoff(Handoff):
    """Prefill role: open the room on arrival, send the KV after prefill, end with the room."""

    def __init__(self, engine: HandoffHost, sender: KVSender) -> None:
        super().__init__(engine)
        self.sender = sender

    def admit(self, req: Request) -> None:
        room_id = _require_room(req)
        try:
            room = self.sender.open_room(room_id, req.request_id)
        except DuplicateRoomError:
            raise _duplicate(room_id) from None
        room.done.add_done_callback(partial(self._on_room_done, req))
        self.engine.enqueue_prefill(req)

    def on_prefilled(
        self,
        req: Request,
        first_token: int,
        logprob: TokenLogprob | None,
        kv_ready: KVReady = ALWAYS_READY,
    ) -> bool:
        req.move(RequestState.PREFILL_INFLIGHT, "prefilled, sending KV")
        self.engine.arm(req, self.engine.config.deadlines.prefill_inflight_s, "timeout:inflight")
        pages = req.seq.page_ids
        lp, top = (logprob.logprob, logprob.top) if logprob is not None else (None, ())
        sent = self.sender.send(
            req.room_id, pages, req.seq.num_prompt_tokens, first_token, lp, top, kv_ready
        )
        if sent:
            req.seq.page_ids = []  # the sender owns them now and releases them via on_release
        return True

    def _on_room_done(self, req: Request, fut: asyncio.Future[RoomOutcome]) -> None:
        outcome = fut.result()
        if req.is_finished:
            return
        if outcome.state == RoomState.SUCCESS:
            self.engine.finish_with(req, [req.seq.token_ids[-1]], "length")
        else:
            self.engine.fail(req, error_for_room(outcome))

    def on_finish(self, req: Request, prev: RequestState, reason: str) -> None:
        self.sender.abort(req.room_id, reason)  # a no-op when the room already ended

    def debug_rooms(self) -> list[dict[str, Any]]:
        return self.sender.table.debug()


class DecodeHandoff(Handoff):
    """Decode role: lend pages to a room, wait for the KV, then join the decode batch."""

    def __init__(self, engine: HandoffHost, receiver: KVReceiver) -> None:
        super().__init__(engine)
        self.receiver = receiver
        self._pending: deque[Request] = deque()  # admitted, waiting for free pages
        self._tasks: set[asyncio.Task[None]] = set()

    def admit(self, req: Request) -> None:
        if req.kv_transfer is None:
            # The router's fallback when no prefill worker is healthy: prefill it here.
            logger.info("req=%s: no kv_transfer_params, prefilling locally", req.request_id)
            self.engine.enqueue_prefill(req)
            return
        if self.receiver.table.get(req.room_id) is not None:
            raise _duplicate(req.room_id)
        req.move(RequestState.WAITING_FOR_KV, "admitted")
        self.engine.arm(
            req, self.engine.config.deadlines.waiting_for_kv_s, "timeout:waiting_for_kv"
        )
        if self.engine.scheduler.is_priority:  # --scheduling-policy priority: lower first
            insert_by_priority(self._pending, req)
        else:
            self._pending.append(req)
        self.on_pages_freed()

    def on_pages_freed(self) -> None:
        alloc, kv = self.engine.allocator, self.engine.runner.kv_config
        cache = self.engine.prefix_cache
        # Age priority: preempted requests, queued again for a re-prefill here, take freed pages
        # before new arrivals (the engine calls this again after each schedule).
        while self._pending and not self.engine.scheduler.waiting:
            req = self._pending[0]
            seq = req.seq
            # Leading prompt pages this decode holds cached are reused, not transferred: the
            # room gets fresh pages only (a shared page is never a transfer destination).
            hit = cache.lookup(seq, req.page_keys)
            need = kv.pages_for(seq.num_prompt_tokens) - len(hit)
            if not cache.can_allocate_with(hit, need):
                return
            self._pending.popleft()
            cache.acquire(seq, hit)
            req.num_prefix_pages = len(hit)
            req.num_cached_prompt_tokens = seq.num_cached_tokens
            pages = alloc.allocate(need)
            seq.page_ids.extend(pages)
            req.pages_in_room = True
            logger.debug(
                "req=%s room=%s: %d prompt pages cached here, %d lent to the room",
                req.request_id, req.room_id, len(hit), len(pages),
            )  # fmt: skip
            task = asyncio.create_task(self._receive(req, pages), name=f"kv-recv-{req.room_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _receive(self, req: Request, pages: list[int]) -> None:
        kvt = req.kv_transfer
        assert kvt is not None
        if req.is_finished:
            # Aborted before this task first ran: no room was opened, so nothing else will
            # release the pages lent to it (the engine left them to the room).
            logger.debug(
                "req=%s room=%s: ended before its room opened", req.request_id, kvt.room_id
            )
            req.pages_in_room = False
            self.engine.free_pages(pages)
            return
        try:
            room = await self.receiver.open_room(
                kvt.room_id, req.request_id, kvt.bootstrap_host, kvt.bootstrap_port,
                pages, req.seq.num_prompt_tokens, req.num_prefix_pages,
            )  # fmt: skip
        except DuplicateRoomError:
            req.pages_in_room = False
            self.engine.fail(req, _duplicate(kvt.room_id))
            return
        except Exception as e:  # the room was never created: the pages are still ours
            logger.exception("req=%s room=%s: open_room failed", req.request_id, kvt.room_id)
            req.pages_in_room = False
            error = EngineError(
                f"bootstrap_error: {e}", 503, "service_unavailable", "bootstrap_error"
            )
            self.engine.fail(req, error)
            return
        outcome = await asyncio.shield(room.done)
        if outcome.state == RoomState.SUCCESS:
            req.pages_in_room = False
            if req.is_finished:  # ended meanwhile (abort raced the last write): pages are ours
                self.engine.free_pages(pages)
                return
            self.engine.start_decoding(req, int(room.data["first_token"]), _first_logprob(room))
        elif not req.is_finished:
            self.engine.fail(req, error_for_room(outcome))

    def on_finish(self, req: Request, prev: RequestState, reason: str) -> None:
        if prev is RequestState.WAITING_FOR_KV:
            if req in self._pending:
                self._pending.remove(req)
            elif req.pages_in_room:
                self.receiver.abort(req.room_id, reason)

    def debug_rooms(self) -> list[dict[str, Any]]:
        return self.receiver.table.debug()
