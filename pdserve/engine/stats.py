"""Engine lifecycle hooks for metrics. The base class only times; the server plugs in Prometheus."""

from __future__ import annotations

import time

from pdserve.engine.request import Request


class EngineObserver:
    """Called on the event loop at each request milestone. Subclasses export the figures."""

    def on_arrival(self, req: Request) -> None:
        pass

    def on_tokens(self, req: Request, num_tokens: int) -> None:
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
            self.on_first_token(req, now - req.arrival)
        elif req.last_token_at is not None and num_tokens:
            self.on_inter_token(req, (now - req.last_token_at) / num_tokens)
        req.last_token_at = now

    def on_first_token(self, req: Request, ttft_s: float) -> None:
        pass

    def on_inter_token(self, req: Request, itl_s: float) -> None:
        pass

    def on_abort(self, req: Request) -> None:
        pass

    def on_timeout(self, req: Request, label: str) -> None:
        pass

    def on_finish(self, req: Request, status: str) -> None:
        pass
