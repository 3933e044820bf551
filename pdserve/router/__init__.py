"""PD-aware OpenAI-compatible router: ``Router(RouterConfig(...))`` or ``pdserve router``."""

from __future__ import annotations

from pdserve.router.app import Router
from pdserve.router.cli import main
from pdserve.router.config import RouterConfig

__all__ = ["Router", "RouterConfig", "main"]
