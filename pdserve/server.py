"""A pdserve worker server of any role, for the CLI and for Python embedding.

```python
import asyncio

from pdserve.model_runner import RunnerConfig
from pdserve.server import Server, ServerConfig

model_dir = "/path/to/model"  # any local HF model directory


async def main() -> None:
    # A colocated worker (EngineConfig's default role), without HTTP: generate() in-process.
    config = ServerConfig(runner=RunnerConfig(model_dir=model_dir), serve_http=False)
    async with Server(config) as server:
        async for delta in server.generate("Hello", max_tokens=16, temperature=0):
            print(delta.text, end="", flush=True)


asyncio.run(main())
```
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector

from pdserve.api.app import build_app, start_http
from pdserve.api.config import ApiConfig
from pdserve.api.drain import DrainGate
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_lease import CpuLease
from pdserve.engine.engine import Engine
from pdserve.engine.handoff import DecodeHandoff, PrefillHandoff
from pdserve.engine.protocol import GenerateOutput, GenerateRequest
from pdserve.engine.runner_thread import RunnerThread
from pdserve.identity import advertise_host, http_url
from pdserve.metrics import EngineCollector, PrometheusObserver, TransferMetrics
from pdserve.model.fingerprint import weights_fingerprint
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.registration import Registration, RegistrationConfig
from pdserve.registration_msg import RegistrationMsg
from pdserve.sampling_params import SamplingParams
from pdserve.tls import TLSConfig
from pdserve.transport import KVReceiver, KVSender, TransportConfig
from pdserve.transport.layout import layout_fingerprint, layout_of, model_fingerprint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    runner: RunnerConfig
    engine: EngineConfig = field(default_factory=EngineConfig)
    transport: TransportConfig | None = None  # prefill/decode roles; derived when None
    api: ApiConfig | None = None  # derived from the engine's model name when None
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    serve_http: bool = True
    # Workers given the same file take turns at the cores for model steps (engine/cpu_lease.py).
    cpu_lease_path: str | None = None
    # The host peers and routers reach this worker at (--advertise-host); None: ``host``,
    # unless that is a wildcard such as 0.0.0.0 (then this machine's primary address).
    advertise_host: str | None = None
    registration: RegistrationConfig | None = None  # --router: register with these routers
    # A drain (SIGTERM, POST /drain) waits this long for requests and KV rooms in flight.
    drain_timeout_s: float = 30.0
    # --ssl-*: HTTPS on the API and the bootstrap port, the CA its own calls verify against.
    tls: TLSConfig = field(default_factory=TLSConfig)

    def __post_init__(self) -> None:
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain timeout must be >= 0, got {self.drain_timeout_s}")

    @property
    def role(self) -> str:
        return self.engine.role


class Server:
    """Owns one engine, its transport (for disaggregated roles) and its HTTP API."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.incarnation = uuid.uuid4().hex
        self.registry = CollectorRegistry()
        # process_resident_memory_bytes and the other process_* series (Linux; nothing elsewhere)
        ProcessCollector(registry=self.registry)
        self.engine: Engine | None = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._http: web.AppRunner | None = None
        self.port: int | None = None
        self.registration: Registration | None = None
        self.advertised_host = advertise_host(config.host, config.advertise_host)
        self.drain_gate = DrainGate()
        self.drain_gate.on_begin(self._on_drain_begin)
        self._drain_task: asyncio.Task[bool] | None = None
        self._stop_code: str | None = None  # the error code requests still running at stop get

    @property
    def url(self) -> str:
        return http_url(self.config.host, self.port, self.config.tls.scheme)

    @property
    def advertised_url(self) -> str:
        """The URL routers and peers use (``--advertise-host``, registration)."""
        assert self.port is not None, "call start() first"
        return http_url(self.advertised_host, self.port, self.config.tls.scheme)

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        cfg = self.config
        # The model loads on the thread that will run its steps (see engine/runner_thread.py).
        lease = CpuLease(cfg.cpu_lease_path) if cfg.cpu_lease_path else None
        runner_thread = RunnerThread(lease=lease)
        try:
            runner = await runner_thread.submit(ModelRunner, cfg.runner)
        except BaseException:
            await runner_thread.stop()
            raise
        observer = PrometheusObserver(cfg.role, self.registry)
        engine = Engine(
            cfg.engine, runner, incarnation=self.incarnation, observer=observer,
            runner_thread=runner_thread,
        )  # fmt: skip
        self.engine = engine
        await self._start_transport(engine, runner)
        self.registry.register(EngineCollector(engine, self._room_table, self._transport_stats))
        await engine.start()
        if cfg.serve_http:
            api = cfg.api or ApiConfig(served_model_name=cfg.engine.model_name)
            app = build_app(engine, api, self.registry, self.drain_gate)
            ctx = cfg.tls.server_context()
            self._http, self.port = await start_http(app, cfg.host, cfg.port, ssl_context=ctx)
            logger.info("%s server ready at %s", cfg.role, self.url)
            if cfg.registration is not None:
                self.registration = Registration(cfg.registration, self._registration_msg())
                self.registration.start()

    def _registration_msg(self) -> RegistrationMsg:
        assert self.engine is not None and self.config.registration is not None
        info = self.engine.info
        host = self.advertised_host
        return RegistrationMsg(
            url=self.advertised_url,
            role=info.role,
            model=info.model_name,
            dtype=info.dtype,
            kv_layout=info.kv_layout,
            weights=info.weights,
            engine_id=info.engine_id,
            incarnation=info.incarnation,
            ttl_s=self.config.registration.ttl_s,
            bootstrap_host=host if info.bootstrap_port is not None else None,
            bootstrap_port=info.bootstrap_port,
        )

    async def deregister(self) -> None:
        """Leave every router this worker registered with (drain and stop call it first, so
        no router sends it new requests); a no-op without ``--router``. Idempotent."""
        if self.registration is not None:
            await self.registration.deregister()

    def _transport_config(self, runner: ModelRunner, weights: str) -> TransportConfig:
        tc = self.config.transport or TransportConfig(engine_id=self.config.engine.engine_id)
        # The identity a peer must share: checked at registration with the page layout.
        return replace(
            tc,
            incarnation=self.incarnation,
            model_name=self.config.engine.model_name,
            model_fingerprint=model_fingerprint(runner.model_config),
            weights_fingerprint=weights,
            tls=self.config.tls,
        )

    async def _start_transport(self, engine: Engine, runner: ModelRunner) -> None:
        # Pages a transport releases (room final, fence lifted) go back to the engine's allocator.
        def release(_room_id: str, pages: list[int]) -> None:
            engine.free_pages(pages)

        role = self.config.role
        # Which weights this worker serves: one architecture with other weights must not pair.
        weights = weights_fingerprint(runner.config.model_dir) if role != "colocated" else ""
        if role == "prefill":
            metrics = TransferMetrics(role, self.registry)
            tc = self._transport_config(runner, weights)
            self.sender = KVSender(tc, runner.kv_pool, release, metrics)
            await self.sender.start()
            engine.attach_handoff(PrefillHandoff(engine, self.sender), self.sender.bootstrap_port)
        elif role == "decode":
            tc = self._transport_config(runner, weights)
            self.receiver = KVReceiver(tc, runner.kv_pool, release)
            await self.receiver.start()
            engine.attach_handoff(DecodeHandoff(engine, self.receiver))
        # Published to routers (/server_info, registration), which pair only equal layouts.
        name = self.config.engine.model_name
        layout = layout_of(runner.kv_pool, name, model_fingerprint(runner.model_config))
        engine.info = replace(
            engine.info, dtype=layout.dtype, kv_layout=layout_fingerprint(layout), weights=weights
        )

    def _room_table(self) -> Any:
        transport = self.sender or self.receiver
        return transport.table if transport is not None else None

    def _transport_stats(self) -> dict[str, Any]:
        transport = self.sender or self.receiver
        return dict(transport.stats) if transport is not None else {}

    # ---- drain ------------------------------------------------------------------------------
    @property
    def drained(self) -> asyncio.Task[bool] | None:
        """The drain in progress (its result: whether everything finished in time), or None."""
        return self._drain_task

    async def drain(self, reason: str = "drain requested") -> bool:
        """Readiness off, new requests turned away (retryable 503), then wait up to
        ``drain_timeout_s`` for what is in flight. True if the worker got idle in time; the
        caller then calls :meth:`stop`, which ends whatever is left with ``drain_timeout``."""
        self.drain_gate.begin(reason)
        assert self._drain_task is not None
        return await asyncio.shield(self._drain_task)

    def _on_drain_begin(self, reason: str) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(
            self._wait_idle(reason), name="pdserve-drain"
        )

    async def _wait_idle(self, reason: str) -> bool:
        timeout_s = self.config.drain_timeout_s
        await self.deregister()  # routers that learnt us by registration stop routing here now
        try:
            if self.engine is not None:
                async with asyncio.timeout(timeout_s):
                    await self.engine.wait_idle()
        except TimeoutError:
            self._stop_code = "drain_timeout"
            num_left = self.engine.load()["num_requests"] if self.engine is not None else 0
            logger.warning(
                "drain: %s not idle after %gs (%d requests left); ending them with %s",
                self.config.role, timeout_s, num_left, self._stop_code,
            )  # fmt: skip
            return False
        logger.info("drain: %s finished its requests in flight (%s)", self.config.role, reason)
        return True

    async def stop(self) -> None:
        await self.deregister()
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
            self._stop_code = "drain_timeout"
        if self.engine is not None:
            # Fail what is left first, so open streams end with a clear error, not a cut.
            await self.engine.stop(code=self._stop_code)
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        for transport in (self.sender, self.receiver):
            if transport is not None:
                await transport.stop()

    # ---- in-process API (no HTTP) -----------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int] | list[dict[str, Any]],
        *,
        request_id: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[GenerateOutput]:
        """Stream deltas for a prompt (text, token ids, or chat messages) on a colocated server."""
        assert self.engine is not None, "call start() first"
        tok = self.engine.tokenizer
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
        elif prompt and isinstance(prompt[0], dict):
            ids = tok.encode(tok.apply_chat_template(prompt), add_special_tokens=False)  # type: ignore[arg-type]
        else:
            ids = list(prompt)  # type: ignore[arg-type]
        req = GenerateRequest(
            request_id or f"embed-{uuid.uuid4().hex}", ids, SamplingParams(**sampling)
        )
        async for out in self.engine.generate(req):
            yield out
