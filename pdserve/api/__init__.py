"""The worker's OpenAI-compatible HTTP layer (aiohttp)."""

from __future__ import annotations

from pdserve.api.app import build_app, start_http
from pdserve.api.config import ApiConfig

__all__ = ["ApiConfig", "build_app", "start_http"]
