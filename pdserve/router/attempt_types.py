"""The vocabulary of one attempt, shared by the dispatcher and :class:`Attempt`: its plan (the
path), its legs and their outcomes, and how an attempt ends."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from pdserve.router.config import RouterConfig
from pdserve.router.legs import PrimaryStart, UpstreamClient, UpstreamReply
from pdserve.router.stats import RouterStats
from pdserve.router.workers import Worker

Spawn = Callable[[Coroutine[Any, Any, Any]], None]

# Leg outcomes. A leg that is pending or broke in transit may still be held by its worker and
# gets an abort; one that got an error reply or never connected does not.
PENDING = "pending"
OK = "ok"
REPLY_ERROR = "reply_error"
CONNECT_ERROR = "connect_error"
TRANSPORT_ERROR = "transport_error"
OUTCOME_BY_KIND = {"connect": CONNECT_ERROR, "transport": TRANSPORT_ERROR}
DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Plan:
    """The path of one attempt: a prefill+decode pair, or one colocated worker."""

    prefill: Worker | None  # None for a colocated path
    primary: Worker
    num_prompt_tokens: int = 0  # what the leg that prefills adds to its worker's backlog


@dataclass(frozen=True, slots=True)
class AttemptEnv:
    """What every attempt shares, owned by the dispatcher."""

    config: RouterConfig
    upstream: UpstreamClient
    stats: RouterStats
    spawn: Spawn


@dataclass(eq=False)
class Leg:
    """One HTTP call of an attempt."""

    worker: Worker
    task: asyncio.Task[Any]
    outcome: str = PENDING
    start: PrimaryStart | None = None
    has_verdict: bool = False  # the breaker was told success or failure
    is_counted: bool = True  # holds one of the worker's in-flight slots
    num_tokens: int = 0  # prompt tokens it holds of the worker's in-flight backlog

    def release_in_flight(self) -> None:
        if self.is_counted:
            self.is_counted = False
            self.worker.num_in_flight -= 1
            self.release_tokens()

    def release_tokens(self) -> None:
        """Its prompt is prefilled (the first byte came): no longer part of the backlog."""
        self.worker.num_in_flight_tokens -= self.num_tokens
        self.num_tokens = 0


class AttemptFailed(Exception):
    """An attempt failed before the first byte reached the client."""

    def __init__(
        self,
        reason: str,
        *,
        status: int = 502,
        blame: Worker | None = None,
        reply: UpstreamReply | None = None,
        is_final: bool = False,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status  # the router's own status if there is no reply to pass on
        self.blame = blame
        self.reply = reply  # the worker's error reply, returned as-is if this is the last word
        self.is_final = is_final  # a client error: do not retry


class StreamBroken(Exception):
    """The primary's stream broke after bytes reached the client, and the request can be
    resumed elsewhere (its :class:`~pdserve.router.migration.StreamTracker` says where)."""

    def __init__(self, reason: str, blame: Worker) -> None:
        super().__init__(reason)
        self.reason = reason
        self.blame = blame


class ClientGone(Exception):
    """Writing to the client failed: it disconnected mid-stream."""

    def __init__(self, response: web.StreamResponse, reason: str) -> None:
        super().__init__(reason)
        self.response = response  # already prepared; the handler must return this one


@dataclass(frozen=True, slots=True)
class Committed:
    """An attempt whose answer went to the client."""

    response: web.StreamResponse
    outcome: str  # stats label: the HTTP status, or "stream_error"


def build_leg_bodies(body: dict[str, Any], kv: dict[str, Any]) -> tuple[bytes, bytes]:
    """(prefill body, decode body): the same request plus ``kv_transfer_params``; the prefill
    leg never streams."""
    decode = {**body, "kv_transfer_params": kv}
    prefill = {k: v for k, v in decode.items() if k != "stream_options"}
    prefill["stream"] = False
    return orjson.dumps(prefill), orjson.dumps(decode)
