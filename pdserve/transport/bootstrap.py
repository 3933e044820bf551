"""The bootstrap channel: an aiohttp server on the prefill side and the client the decode side uses.

Routes (all bodies orjson, validated into ``*Msg`` before anything is touched):

- ``POST /register``         RegisterMsg -> RegisterReplyMsg (decode agent metadata + pool)
- ``POST /rooms/{room_id}``  RoomMsg -> {} (destination pages of one room)
- ``POST /abort/{room_id}``  AbortMsg -> AbortReplyMsg (decode-side abort / ack request)
- ``POST /heartbeat``        HeartbeatMsg -> HeartbeatReplyMsg
- ``GET  /peers``            debug view of the registered decode peers

Errors are ``{"error": {"code", "message"}}`` with 400 (malformed), 401 (missing or wrong
bootstrap token, when the server has one), 404 (unknown peer: register first), 409 (duplicate
room, stale incarnation) or 410 (room already aborted). The server knows
nothing about rooms: it validates, then calls its :class:`BootstrapHandler` (the KVSender).
"""

from __future__ import annotations

import hmac
import logging
import ssl
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiohttp
import orjson
from aiohttp import web

from pdserve.tls import TLSConfig
from pdserve.transport.messages import (
    AbortMsg,
    AbortReplyMsg,
    HeartbeatMsg,
    HeartbeatReplyMsg,
    RegisterMsg,
    RegisterReplyMsg,
    RoomMsg,
)
from pdserve.transport.wire import MAX_ID_LEN, MessageError, decode, encode, error_body

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
# The header that carries the shared secret of the bootstrap port (--bootstrap-token).
TOKEN_HEADER = "X-PDServe-Bootstrap-Token"
R = TypeVar("R")


class ProtocolError(Exception):
    """Raised by a handler to answer with an HTTP error (status, machine code, message)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class BootstrapHandler(Protocol):
    """What the bootstrap server delegates to (implemented by KVSender)."""

    async def on_register(self, msg: RegisterMsg) -> RegisterReplyMsg: ...
    def on_room(self, room_id: str, msg: RoomMsg) -> None: ...
    def on_abort(self, room_id: str, msg: AbortMsg) -> AbortReplyMsg: ...
    def on_heartbeat(self, msg: HeartbeatMsg) -> HeartbeatReplyMsg: ...
    def debug_peers(self) -> list[dict[str, Any]]: ...


@dataclass
class BootstrapServerStats:
    """Plain counters (read at scrape time)."""

    requests: int = 0
    bad_requests: int = 0  # 400: malformed or out-of-range messages
    rejected: int = 0  # 404/409/410 answers
    unauthorized: int = 0  # 401: missing or wrong bootstrap token


class BootstrapServer:
    """aiohttp server of the prefill side. One per KVSender; binds ``host:port`` (0 = ephemeral).

    With a ``token`` every request (``/peers`` included) must carry it in ``TOKEN_HEADER``;
    the comparison is constant-time.
    """

    def __init__(
        self,
        handler: BootstrapHandler,
        host: str,
        port: int,
        max_room_pages: int,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.handler = handler
        self._ssl_context = ssl_context  # None: plain HTTP
        self._token = token.encode() if token is not None else None
        self.host = host
        self.port = port
        self.max_room_pages = max_room_pages
        self.stats = BootstrapServerStats()
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Bind and serve; afterwards ``port`` is the actual port."""
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._check_token])
        app.add_routes(
            [
                web.post("/register", self._register),
                web.post("/rooms/{room_id}", self._room),
                web.post("/abort/{room_id}", self._abort),
                web.post("/heartbeat", self._heartbeat),
                web.get("/peers", self._peers),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self._ssl_context)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the real port when 0 was asked
        logger.info("bootstrap server listening on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _check_token(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self._token is not None:
            given = request.headers.get(TOKEN_HEADER, "").encode()
            if not hmac.compare_digest(given, self._token):
                self.stats.unauthorized += 1
                what = "wrong" if given else "missing"
                logger.warning(
                    "bootstrap %s %s from %s: %s token",
                    request.method, request.path, request.remote, what,
                )  # fmt: skip
                msg = f"{what} bootstrap token: start both workers with the same --bootstrap-token"
                return web.Response(status=401, body=error_body("unauthorized", msg), **_JSON)
        return await handler(request)

    # -- routes ----------------------------------------------------------------------------

    async def _register(self, request: web.Request) -> web.Response:
        async def apply() -> RegisterReplyMsg:
            return await self.handler.on_register(decode(RegisterMsg, await request.read()))

        return await self._serve(request, apply)

    async def _room(self, request: web.Request) -> web.Response:
        async def apply() -> dict[str, Any]:
            room_id = _room_id(request)
            raw = orjson.loads(await request.read())
            if not isinstance(raw, dict):
                raise MessageError("message must be a JSON object")
            self.handler.on_room(room_id, RoomMsg.from_dict(raw, self.max_room_pages))
            return {"room_id": room_id}

        return await self._serve(request, apply)

    async def _abort(self, request: web.Request) -> web.Response:
        async def apply() -> AbortReplyMsg:
            room_id = _room_id(request)
            return self.handler.on_abort(room_id, decode(AbortMsg, await request.read()))

        return await self._serve(request, apply)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        async def apply() -> HeartbeatReplyMsg:
            return self.handler.on_heartbeat(decode(HeartbeatMsg, await request.read()))

        return await self._serve(request, apply)

    async def _peers(self, request: web.Request) -> web.Response:
        self.stats.requests += 1
        return web.Response(body=orjson.dumps(self.handler.debug_peers()), **_JSON)

    async def _serve(self, request: web.Request, apply: Any) -> web.Response:
        """Run ``apply`` and map its result or error to a response; errors never escape."""
        self.stats.requests += 1
        try:
            result = await apply()
        except (MessageError, orjson.JSONDecodeError) as e:
            self.stats.bad_requests += 1
            logger.warning("bootstrap %s %s: bad request: %s", request.method, request.path, e)
            return web.Response(status=400, body=error_body("bad_request", str(e)), **_JSON)
        except ProtocolError as e:
            if e.status == 400:
                self.stats.bad_requests += 1
            else:
                self.stats.rejected += 1
            logger.info("bootstrap %s: %d %s: %s", request.path, e.status, e.code, e.message)
            return web.Response(status=e.status, body=error_body(e.code, e.message), **_JSON)
        except Exception as e:  # a handler bug: answer in the protocol's shape, keep serving
            logger.exception("bootstrap %s %s failed", request.method, request.path)
            return web.Response(status=500, body=error_body("internal", repr(e)), **_JSON)
        body = orjson.dumps(result) if isinstance(result, dict) else encode(result)
        return web.Response(body=body, **_JSON)


_JSON: dict[str, Any] = {"content_type": "application/json"}


def _room_id(request: web.Request) -> str:
    room_id = request.match_info["room_id"]
    if not room_id or len(room_id) > MAX_ID_LEN:
        raise MessageError(f"room id must be 1..{MAX_ID_LEN} characters")
    return room_id


# -- client ----------------------------------------------------------------------------------------


class BootstrapError(Exception):
    """A bootstrap request that did not get a valid answer."""


class PeerUnreachableError(BootstrapError):
    """No connection could be made: the request was certainly not delivered."""


class PeerIOError(BootstrapError):
    """Connected, but no valid answer (timeout, reset): the request may have been applied."""


class PeerRejectedError(BootstrapError):
    """The server answered with an error status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class BootstrapClient:
    """The decode side's HTTP client of prefill bootstrap servers (one session, many hosts);
    sends ``token`` (the shared bootstrap secret) on every request when given; speaks HTTPS,
    verifying the prefill against ``tls.ca_certs``, when ``tls`` is enabled."""

    def __init__(
        self,
        connect_timeout_s: float,
        request_timeout_s: float,
        token: str | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self._tls = tls or TLSConfig()
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._headers = {TOKEN_HEADER: token} if token is not None else {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the HTTP session (must run on the loop that will use it)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._tls.client_context())
            self._session = aiohttp.ClientSession(connector=connector)

    async def close(self) -> None:
        """Close the session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def register(self, host: str, port: int, msg: RegisterMsg) -> RegisterReplyMsg:
        """POST /register."""
        return await self._post(host, port, "/register", msg, RegisterReplyMsg)

    async def post_room(self, host: str, port: int, room_id: str, msg: RoomMsg) -> None:
        """POST /rooms/{room_id} (destination pages)."""
        await self._post(host, port, f"/rooms/{room_id}", msg, None)

    async def abort(self, host: str, port: int, room_id: str, msg: AbortMsg) -> AbortReplyMsg:
        """POST /abort/{room_id}."""
        return await self._post(host, port, f"/abort/{room_id}", msg, AbortReplyMsg)

    async def heartbeat(
        self, host: str, port: int, msg: HeartbeatMsg, timeout_s: float
    ) -> HeartbeatReplyMsg:
        """POST /heartbeat with its own (short) timeout."""
        return await self._post(host, port, "/heartbeat", msg, HeartbeatReplyMsg, timeout_s)

    async def _post(
        self,
        host: str,
        port: int,
        path: str,
        msg: Any,
        reply_cls: type[R] | None,
        timeout_s: float | None = None,
    ) -> R:
        if self._session is None:
            raise RuntimeError("BootstrapClient.start() was not called")
        total = timeout_s if timeout_s is not None else self.request_timeout_s
        timeout = aiohttp.ClientTimeout(
            total=total, sock_connect=min(total, self.connect_timeout_s)
        )
        url = f"{self._tls.scheme}://{host}:{port}{path}"
        try:
            async with self._session.post(
                url, data=encode(msg), timeout=timeout, headers=self._headers
            ) as resp:
                body = await resp.read()
                status = resp.status
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise PeerUnreachableError(f"{host}:{port} unreachable: {e}") from None
        except (TimeoutError, aiohttp.ClientError) as e:
            raise PeerIOError(f"{host}:{port}{path}: {type(e).__name__}: {e}") from None
        if status != 200:
            raise _rejection(status, body)
        if reply_cls is None:
            return None  # type: ignore[return-value]
        try:
            return decode(reply_cls, body)
        except MessageError as e:
            raise PeerIOError(f"{host}:{port}{path}: invalid reply: {e}") from None


def _rejection(status: int, body: bytes) -> PeerRejectedError:
    try:
        err = orjson.loads(body)["error"]
        return PeerRejectedError(status, str(err["code"]), str(err["message"]))
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return PeerRejectedError(status, "http_error", body[:200].decode("utf-8", "replace"))
