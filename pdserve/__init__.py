"""pdserve: prefill/decode disaggregated LLM serving, asyncio-native, with KV transfer over NIXL."""

from __future__ import annotations

__version__ = "0.1.0"
