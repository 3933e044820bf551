"""The router's fleet endpoints: workers announcing themselves (``POST /workers/register``,
``POST /workers/deregister``; the registration token's) and the operator's list, add and remove
(``GET``/``POST``/``DELETE /workers``; the admin key's).

A registration (each renewal too) upserts the worker and extends its lease. A URL the registry
does not hold yet, registered or added, is vetted first (router/vetting.py: http(s), a host in
``--worker-allow``, pdserve's identity with the fleet's model) and joins with the result of that
probe, so the answer carries its real state. Every refusal is a 4xx in the OpenAI error shape
naming the field.
"""

from __future__ import annotations

import logging
import time
from urllib.parse import urlsplit

import orjson
from aiohttp import web

from pdserve.registration_msg import DeregistrationMsg, RegistrationMsg, normalize_worker_url
from pdserve.router.config import WORKER_ROLES
from pdserve.router.errors import error_response
from pdserve.router.health import HealthChecker, ProbeResult, apply_probe
from pdserve.router.vetting import Refusal, WorkerVetting
from pdserve.router.workers import Worker, WorkerManager

logger = logging.getLogger(__name__)


class RegistryApi:
    """The fleet handlers, bound to one router's registry, health checker and vetting."""

    def __init__(
        self, workers: WorkerManager, health: HealthChecker, vetting: WorkerVetting
    ) -> None:
        self._workers = workers
        self._health = health
        self._vetting = vetting

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/workers", self.list_workers)
        app.router.add_post("/workers", self.add_worker)
        app.router.add_delete("/workers", self.remove_worker)
        app.router.add_post("/workers/register", self.register)
        app.router.add_post("/workers/deregister", self.deregister)

    async def register(self, request: web.Request) -> web.Response:
        try:
            msg = RegistrationMsg.from_json(orjson.loads(await request.read()))
        except orjson.JSONDecodeError:
            return error_response(400, "request body is not valid JSON")
        except ValueError as exc:
            return error_response(400, f"invalid registration: {exc}", param=_field(exc))
        probe = None
        if self._workers.get(msg.url) is None:
            vetted = await self._vet(msg.url, msg.role, msg)
            if isinstance(vetted, web.Response):
                return vetted
            probe = vetted
        try:
            worker, is_new = self._workers.register(msg)
        except ValueError as exc:
            return error_response(409, str(exc), param="role")
        if is_new and probe is not None:
            self._join(worker, probe)
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

    async def list_workers(self, request: web.Request) -> web.Response:
        data = [w.to_json() for w in self._workers.all()]
        return web.Response(body=orjson.dumps({"data": data}), content_type="application/json")

    async def add_worker(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return error_response(400, "request body is not valid JSON")
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            return error_response(400, 'expected {"url": str, "role": str}', param="url")
        try:
            url = normalize_worker_url(body["url"])
            role = body.get("role", "")
            if self._workers.get(url) is not None:
                raise ValueError(f"worker already registered: {url}")
            if role not in WORKER_ROLES:
                raise ValueError(f"role must be one of {WORKER_ROLES}, got {role!r}")
        except ValueError as exc:
            status = 409 if "already registered" in str(exc) else 400
            return error_response(status, str(exc), param="role" if "role" in str(exc) else "url")
        vetted = await self._vet(url, role)
        if isinstance(vetted, web.Response):
            return vetted
        try:
            worker = self._workers.add(url, role)
        except ValueError as exc:  # added by someone else while this one was probed
            return error_response(409, str(exc), param="url")
        self._join(worker, vetted)
        return web.Response(
            status=201, body=orjson.dumps(worker.to_json()), content_type="application/json"
        )

    async def remove_worker(self, request: web.Request) -> web.Response:
        url = request.query.get("url")
        if not url:
            return error_response(400, "missing query parameter url", param="url")
        if self._workers.remove(url) is None:
            return error_response(404, f"no worker registered at {url}", param="url")
        return web.Response(body=orjson.dumps({"removed": url}), content_type="application/json")

    async def _vet(
        self, url: str, role: str, claim: RegistrationMsg | None = None
    ) -> ProbeResult | web.Response:
        vetted = await self._vetting.vet(url, urlsplit(url).hostname or "", role, claim)
        if isinstance(vetted, Refusal):
            logger.warning("%s", vetted.message)
            return error_response(
                vetted.status, vetted.message, param=vetted.param, code=vetted.code
            )
        return vetted

    def _join(self, worker: Worker, probe: ProbeResult) -> None:
        """A vetted worker takes the state its vetting probe found (no second probe)."""
        apply_probe(worker, probe, time.monotonic())
        self._workers.refresh_compatibility()


def _field(exc: ValueError) -> str | None:
    """The field a validation message starts with (``"ttl_s must be ..."`` -> ``ttl_s``)."""
    word = str(exc).split(" ", 1)[0]
    return word if word.isidentifier() else None
