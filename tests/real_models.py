"""Real models for tests, by name: the path of a fetched GGUF file.

Where a model cannot be had the test fails (CI can always fetch it), unless ``PDSERVE_OFFLINE=1``
opts into skipping for offline development.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve import envs
from pdserve.model.fetch import FetchError, default_models_dir, fetch_model

SMOLLM2 = "smollm2-135m-instruct"
QWEN_05B = "qwen2.5-coder-0.5b-instruct"
QWEN_15B = "qwen2.5-coder-1.5b-instruct"
_QWEN_FILES = {
    QWEN_05B: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    QWEN_15B: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}


def real_model(name: str) -> Path:
    """The model's GGUF path; fails where it cannot be had (skips under PDSERVE_OFFLINE=1)."""
    try:
        if name == SMOLLM2:
            return fetch_model()
        path = default_models_dir() / _QWEN_FILES[name]
        if not path.is_file():
            raise FetchError(f"{path} is absent")
        return path
    except FetchError as e:
        if envs.offline():
            pytest.skip(f"{name} cannot be had here (PDSERVE_OFFLINE=1): {e}")
        raise
