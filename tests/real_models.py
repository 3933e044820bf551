"""Real models for tests, by name (``pdserve fetch-model --name``): the path of a fetched GGUF
file whose pinned SHA-256 was checked.

Where a model cannot be had the test fails (CI can always fetch it), unless ``PDSERVE_OFFLINE=1``
opts into skipping for offline development.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve import envs
from pdserve.model.fetch import FetchError, fetch_model
from pdserve.model.model_table import DEFAULT_MODEL

SMOLLM2 = DEFAULT_MODEL
QWEN_05B = "qwen2.5-coder-0.5b-instruct"
QWEN_15B = "qwen2.5-coder-1.5b-instruct"


def real_model(name: str) -> Path:
    """The model's GGUF path; fails where it cannot be had (skips under PDSERVE_OFFLINE=1)."""
    try:
        return fetch_model(name=name)
    except FetchError as e:
        if envs.offline():
            pytest.skip(f"{name} cannot be had here (PDSERVE_OFFLINE=1): {e}")
        raise
