"""``POST /workers/register`` and ``POST /workers/deregister``: workers announcing themselves.

A registration (each renewal too) upserts the worker and extends its lease; a new worker is
probed at once so the answer carries its real state. Both answer in the OpenAI error shape on
bad input, naming the field.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from pdserve.registration_msg import DeregistrationMsg, RegistrationMsg
from pdserve.router.errors import error_response
from pdserve.router.health import HealthChecker
from pdserve.router.workers import WorkerManager


class RegistryApi:
    """The two handlers, bound to one router's registry and health checker."""

    def __init__(self, workers: WorkerManager, health: HealthChecker) -> None:
        self._workers = workers
        self._health = health

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/workers/register", self.register)
        app.router.add_post("/workers/deregister", self.deregister)

    async def register(self, request: web.Request) -> web.Response:
        try:
            msg = RegistrationMsg.from_json(orjson.loads(await request.read()))
        except orjson.JSONDecodeError:
            return error_response(400, "request body is not valid JSON")
        except ValueError as exc:
            return error_response(400, f"invalid registration: {exc}", param=_field(exc))
        try:
            worker, is_new = self._workers.register(msg)
        except ValueError as exc:
            return error_response(409, str(exc), param="role")
        if is_new:  # bounded by health_timeout_s; renewals do not wait for a probe
            await self._health.check(worker)
        body = {**worker.to_json(), "lease_s": msg.ttl_s}
        return web.Response(
            status=201 if is_new else 200, body=orjson.dumps(body), content_type="application/json"
        )

    async def deregister(self, request: web.Request) -> web.Response:
        try:
            msg = DeregistrationMsg.from_json(orjson.loads(await request.read()))
        except orjson.JSONDecodeError:
            return error_response(400, "request body is not valid JSON")
        except ValueError as exc:
            return error_response(400, f"invalid deregistration: {exc}", param=_field(exc))
        removed = self._workers.deregister(msg) is not None
        return web.Response(
            body=orjson.dumps({"url": msg.url, "removed": removed}),
            content_type="application/json",
        )


def _field(exc: ValueError) -> str | None:
    """The field a validation message starts with (``"ttl_s must be ..."`` -> ``ttl_s``)."""
    word = str(exc).split(" ", 1)[0]
    return word if word.isidentifier() else None
