"""The decode side's hand-shake of one room: register with the prefill, post the pages.

Registration is shared per prefill address (``liveness.PrefillLinkManager``). A prefill that
forgot us (404: it declared us lost, or restarted) is registered with again and the pages
posted again, up to ``MAX_POST_ATTEMPTS`` times. ``room.data["posted"]`` records whether the
sender could know our pages ("no" / "maybe" / "yes"): what the fence rule needs when the room
fails.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.fsm import BOOTSTRAPPED, Room, RoomState, RoomTable
from pdserve.transport.bootstrap import (
    BootstrapClient,
    PeerIOError,
    PeerRejectedError,
    PeerUnreachableError,
)
from pdserve.transport.config import TransportConfig
from pdserve.transport.liveness import BootstrapFailed, PrefillLink, PrefillLinkManager
from pdserve.transport.messages import RoomMsg
from pdserve.transport.stats import ReceiverStats

_BOOTSTRAPPING = RoomState.BOOTSTRAPPING.value
MAX_POST_ATTEMPTS = 3  # re-register and re-post when the prefill forgot us in between


class Handshake:
    """Runs the hand-shake of one receiver's rooms: its ``table``, its prefill ``links`` and
    HTTP ``client``; ``fail(room, reason)`` is the receiver's (it records whether the sender
    is dead, for the fence)."""

    def __init__(
        self,
        config: TransportConfig,
        client: BootstrapClient,
        links: PrefillLinkManager,
        table: RoomTable,
        counters: ReceiverStats,
        fail: Callable[[Room, str], None],
    ) -> None:
        self.config = config
        self.client = client
        self.links = links
        self.table = table
        self.counters = counters
        self.fail = fail

    def is_live(self, room: Room) -> bool:
        return self.table.get(room.room_id) is room

    async def run(self, room: Room) -> None:
        """Register (if needed) and post the room's pages; every failure ends the room."""
        host, port = room.data["host"], room.data["port"]
        for attempt in range(MAX_POST_ATTEMPTS):
            try:
                link = await self.links.connect(host, port, room.deadline_at or 0.0)
            except BootstrapFailed as e:
                self.counters.bootstrap_errors += 1
                self.fail(room, str(e))
                return
            if not self.is_live(room):
                return  # ended while registering: the sender never saw our pages
            room.data.update(sender_key=link.key, sender_agent=link.agent_name)
            room.data["sender_incarnation"] = link.incarnation
            if await self._post_room(room, link, is_last_try=attempt == MAX_POST_ATTEMPTS - 1):
                return

    async def _post_room(self, room: Room, link: PrefillLink, is_last_try: bool) -> bool:
        """POST the pages; True when done (either way), False to re-register and retry."""
        cfg = self.config
        msg = RoomMsg(
            cfg.engine_id,
            cfg.incarnation,
            room.data["nonce"],
            room.page_ids,
            room.data["num_tokens"],
            room.data["num_cached_pages"],
        )
        room.data["posted"] = "maybe"
        try:
            await self.client.post_room(link.host, link.port, room.room_id, msg)
        except PeerRejectedError as e:
            room.data["posted"] = "no"
            if e.status == 404 and not is_last_try:  # it forgot us: register again
                room.data.pop("sender_key", None)  # this room is retried, not failed with the link
                self.links.lose(
                    link, f"peer_lost: prefill no longer knows this decode ({e})", False
                )
                return False
            if e.status == 410:  # the prefill ended this room before our pages got there
                room.data["peer_aborted"] = True
                self.fail(room, f"aborted: by prefill ({e.message})")
            else:
                self.fail(room, f"bootstrap_error: {e}")
            return True
        except (PeerUnreachableError, PeerIOError) as e:
            if isinstance(e, PeerUnreachableError):
                room.data["posted"] = "no"
            self.counters.bootstrap_errors += 1
            self.fail(room, f"bootstrap_error: posting pages: {e}")
            return True
        room.data["posted"] = "yes"
        if not self.is_live(room):
            return True  # failed meanwhile: its fence entry already asks the sender
        if self.links.get(link.host, link.port) is not link:
            self.fail(room, "peer_lost: prefill link lost while posting pages")
            return True
        self.table.bind_peer(room.room_id, link.key)
        if room.state == _BOOTSTRAPPING:  # data may have overtaken this HTTP answer
            self.table.fire(room.room_id, BOOTSTRAPPED)
        return True
