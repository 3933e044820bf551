"""Model side: checkpoint config, weight loading, the Llama-family decoder, tokenizer, demo."""

from __future__ import annotations
