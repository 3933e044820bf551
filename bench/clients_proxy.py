"""A recording pass-through proxy for bench/clients.py: it forwards every request to the target
unchanged (streams included) and saves the first JSON body each flow sends to each path, so
the tests can replay exactly what the real clients send."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


def _save(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _app(upstream: str, record_dir: Path, prefix: str) -> web.Application:
    seen: set[tuple[str, ...]] = set()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.path
        shape = (path, *sorted(json.loads(body))) if request.method == "POST" and body else ()
        if shape and shape not in seen:  # the first body of each shape (fields sent) per path
            seen.add(shape)
            name = f"{prefix}-{path.strip('/').replace('/', '_')}-{len(seen)}.json"
            text = json.dumps(json.loads(body), indent=1, sort_keys=True) + "\n"
            await asyncio.to_thread(_save, record_dir / name, text)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        session: aiohttp.ClientSession = request.app["session"]
        async with session.request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as up:
            out = web.StreamResponse(status=up.status)
            for k, v in up.headers.items():
                if k.lower() not in _HOP_HEADERS and k.lower() != "content-encoding":
                    out.headers[k] = v
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
            app["session"] = session
            yield

    app = web.Application(client_max_size=64 << 20)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


@contextmanager
def maybe_recording(url: str, record_dir: Path | None, flow: str, label: str) -> Iterator[str]:
    """``url`` itself, or (``record_dir`` set) a recording proxy's URL in front of it."""
    if record_dir is None:
        yield url
        return
    loop = asyncio.new_event_loop()
    started: dict[str, object] = {}
    ready = threading.Event()

    async def start() -> None:
        runner = web.AppRunner(_app(url, record_dir, f"{flow}-{label}"))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        started["runner"] = runner
        started["port"] = runner.addresses[0][1]
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield f"http://127.0.0.1:{started['port']}"
    finally:
        runner = started["runner"]
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)  # type: ignore[attr-defined]
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
