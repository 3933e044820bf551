"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) answers through a worker."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import WORKER_ARGS, Proc, free_port
from tests.real_models import SMOLLM2, real_model


@pytest.fixture(scope="module")
def smollm_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    model = real_model(SMOLLM2)
    tmp, port = tmp_path_factory.mktemp("smollm"), free_port()
    argv = ["serve", "--role", "colocated", "--model", str(model), "--port", str(port),
            "--engine-id", "smollm", *WORKER_ARGS]  # fmt: skip
    p = Proc("smollm", argv, f"http://127.0.0.1:{port}", Path(tmp) / "smollm.log").start()
    try:
        yield p.wait_ready()
    finally:
        p.stop()


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_the_default_model_says_paris_is_the_capital_of_france(smollm_worker: Proc) -> None:
    with urllib.request.urlopen(f"{smollm_worker.url}/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["SmolLM2-135M-Instruct"]
    out = _post(
        f"{smollm_worker.url}/v1/chat/completions",
        {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        },
    )
    answer = out["choices"][0]["message"]["content"]  # type: ignore[index]
    assert "Paris" in answer, answer
    assert out["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]  # <|im_end|>
