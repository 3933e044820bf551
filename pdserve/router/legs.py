"""HTTP calls to workers for one request leg: the prefill leg, the primary leg (decode or
colocated: its response goes to the client), the stream pump, and best-effort aborts.

Everything here raises :class:`LegError` for worker-side failures, so the dispatcher can tell
them apart from the client going away.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from pdserve.keepalive import KEEPALIVE_HEADER
from pdserve.router.config import RouterConfig
from pdserve.router.prompt_size import count_from_reply
from pdserve.router.workers import Worker

logger = logging.getLogger(__name__)

# Worker answers that describe the client's request: returned as they are, never retried.
CLIENT_ERROR_STATUSES = frozenset({400, 404, 413, 422})

SSE_CONTENT_TYPE = "text/event-stream"
WriteFn = Callable[[bytes], Awaitable[None]]
_EVENT_END = b"\n\n"


# Error codes a PD worker uses when a request failed because of its KV peer (engine/handoff.py).
PEER_FAILURE_CODES = (
    "peer_lost", "transfer_error", "bootstrap_error", "aborted",
    "timeout:Bootstrapping", "timeout:WaitingForInput", "timeout:Transferring",
    "timeout:waiting_for_kv", "timeout:inflight",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class UpstreamReply:
    """A complete worker answer (used for error replies and non-streaming bodies)."""

    status: int
    body: bytes
    content_type: str

    @property
    def is_client_error(self) -> bool:
        return self.status in CLIENT_ERROR_STATUSES

    @property
    def is_peer_failure(self) -> bool:
        """The worker answered that its KV peer failed (lost, transfer error, room timeout):
        the worker itself is healthy, so its circuit breaker must not count this."""
        if self.status not in (503, 504):
            return False
        code = _error_code(self.body)
        return code is not None and code.startswith(PEER_FAILURE_CODES)

    @property
    def is_draining(self) -> bool:
        """The worker turned the request away because it is draining (api/drain.py): retry on
        another worker; the worker is fine, but take it out of rotation now."""
        return self.status == 503 and _error_code(self.body) == "draining"


def _error_code(body: bytes) -> str | None:
    try:
        code = orjson.loads(body)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


class LegError(Exception):
    """A leg failed on the worker side: unreachable, broken, timed out, or non-2xx."""

    def __init__(
        self, worker: Worker, reason: str, reply: UpstreamReply | None = None, *, kind: str
    ) -> None:
        super().__init__(f"{worker.url}: {reason}")
        self.worker = worker
        self.reason = reason
        self.reply = reply
        self.kind = kind  # "connect" | "transport" | "reply" | "stream_error"


@dataclass(slots=True)
class PrimaryStart:
    """The primary leg's answer up to its first complete event (or its whole body)."""

    response: aiohttp.ClientResponse
    first: bytes  # first complete SSE event(s), or the whole body when not SSE
    rest: bytes  # bytes after the last complete event (SSE only)
    is_sse: bool
    is_eof: bool


class UpstreamClient:
    """Sends legs over the router's single ClientSession, with timeouts on every call."""

    def __init__(self, config: RouterConfig, session: aiohttp.ClientSession) -> None:
        self._session = session
        self._leg_timeout = aiohttp.ClientTimeout(
            total=config.request_timeout_s, sock_connect=config.connect_timeout_s
        )
        self._abort_timeout = aiohttp.ClientTimeout(
            total=config.abort_timeout_s, sock_connect=config.connect_timeout_s
        )
        self._auth = (
            {"Authorization": f"Bearer {config.worker_api_key}"} if config.worker_api_key else {}
        )

    def headers(self, request_id: str) -> dict[str, str]:
        # The router sends the client's keep-alives itself (router/client_stream.py).
        return {
            "Content-Type": "application/json", "X-Request-Id": request_id,
            KEEPALIVE_HEADER: "0", **self._auth,
        }  # fmt: skip

    async def run_prefill(self, worker: Worker, path: str, request_id: str, body: bytes) -> int:
        """Send the prefill leg and read its whole answer; returns the 2xx status.

        The body of a successful prefill is discarded: only the decode leg's answer is shown.
        """
        try:
            async with self._session.post(
                worker.url + path,
                data=body,
                headers=self.headers(request_id),
                timeout=self._leg_timeout,
            ) as resp:
                data = await resp.read()
                if resp.status >= 300:
                    reply = UpstreamReply(resp.status, data, resp.content_type)
                    raise LegError(worker, f"prefill answered {resp.status}", reply, kind="reply")
                return resp.status
        except aiohttp.ClientConnectorError as exc:
            raise LegError(worker, f"connect failed: {exc}", kind="connect") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegError(worker, f"{type(exc).__name__}: {exc}", kind="transport") from exc

    async def open_primary(
        self, worker: Worker, path: str, request_id: str, body: bytes
    ) -> PrimaryStart:
        """Send the primary leg and read up to its first complete SSE event (whole body if
        not SSE). The response stays open for :func:`pump_events` on success."""
        try:
            resp = await self._session.post(
                worker.url + path,
                data=body,
                headers=self.headers(request_id),
                timeout=self._leg_timeout,
            )
        except aiohttp.ClientConnectorError as exc:
            raise LegError(worker, f"connect failed: {exc}", kind="connect") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegError(worker, f"{type(exc).__name__}: {exc}", kind="transport") from exc
        try:
            return await self._read_start(worker, resp)
        except BaseException:
            resp.close()  # drops the connection, so the worker sees its client leave
            raise

    async def _read_start(self, worker: Worker, resp: aiohttp.ClientResponse) -> PrimaryStart:
        try:
            is_sse = resp.content_type == SSE_CONTENT_TYPE
            if resp.status >= 300 or not is_sse:
                data = await resp.read()
                if resp.status >= 300:
                    reply = UpstreamReply(resp.status, data, resp.content_type)
                    raise LegError(worker, f"answered {resp.status}", reply, kind="reply")
                return PrimaryStart(resp, data, b"", is_sse=False, is_eof=True)
            buf = b""
            while (end := buf.rfind(_EVENT_END)) < 0:
                chunk = await resp.content.readany()
                if not chunk:
                    raise LegError(worker, "stream ended before its first event", kind="transport")
                buf += chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegError(worker, f"{type(exc).__name__}: {exc}", kind="transport") from exc
        first, rest = buf[: end + 2], buf[end + 2 :]
        error = first_event_error(first)
        if error is not None:
            raise LegError(worker, f"stream began with an error: {error}", kind="stream_error")
        return PrimaryStart(resp, first, rest, is_sse=True, is_eof=False)

    async def count_tokens(self, worker: Worker, body: dict[str, Any]) -> int | None:
        """A prompt's token count by the worker's ``POST /tokenize`` (router/prompt_size.py),
        bounded by the abort timeout; None (logged) if it did not answer one."""
        headers = {"Content-Type": "application/json", **self._auth}
        try:
            async with self._session.post(
                f"{worker.url}/tokenize", data=orjson.dumps(body), headers=headers,
                timeout=self._abort_timeout,
            ) as resp:  # fmt: skip
                raw = await resp.read()
                count = count_from_reply(raw) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.info("tokenize at %s failed: %s", worker.url, exc)
            return None
        if count is None:
            logger.info("tokenize at %s answered %d without a count", worker.url, resp.status)
        return count

    async def post_abort(self, worker: Worker, request_id: str) -> bool:
        """Best effort ``POST /abort/{rid}``; False (logged) if the worker did not confirm."""
        try:
            async with self._session.post(
                f"{worker.url}/abort/{request_id}", headers=self._auth, timeout=self._abort_timeout
            ) as resp:
                await resp.read()
                logger.debug("abort rid=%s at %s -> %s", request_id, worker.url, resp.status)
                return resp.status < 300
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.info("abort rid=%s at %s failed: %s", request_id, worker.url, exc)
            return False


def first_event_error(events: bytes) -> str | None:
    """The error message if the first SSE event is an OpenAI error object, else None."""
    first = events.split(_EVENT_END, 1)[0]
    for line in first.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload.startswith(b"{"):
            return None
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return None
        if isinstance(obj, dict) and "error" in obj:
            err = obj["error"]
            return str(err.get("message", err)) if isinstance(err, dict) else str(err)
        return None
    return None


async def pump_events(worker: Worker, start: PrimaryStart, write: WriteFn) -> None:
    """Copy the rest of an SSE stream to the client, one complete event batch per write, so
    an error event we append after a break never lands in the middle of a half-sent event.

    Raises LegError when the worker side breaks; errors from ``write`` propagate unchanged.
    """
    buf = start.rest
    content = start.response.content
    while True:
        try:
            chunk = await content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            reason = f"stream broke: {type(exc).__name__}: {exc}"
            raise LegError(worker, reason, kind="transport") from exc
        if not chunk:
            break
        buf += chunk
        end = buf.rfind(_EVENT_END)
        if end >= 0:
            await write(buf[: end + 2])
            buf = buf[end + 2 :]
    if buf:
        await write(buf)
