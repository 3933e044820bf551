"""bench/vllm_ref.py launches vLLM tuned for the machine, waits for it, and stops it;
bench/pd_compare.py reports every deployment's ratio to it. A stand-in server plays vLLM (the
real one is not a dependency): it is started the same way, ``python -m
vllm.entrypoints.openai.api_server ...``, from a fake environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import orjson
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import pd_compare  # noqa: E402
from bench.cluster import free_port  # noqa: E402
from bench.vllm_ref import VllmServer, tuned_env  # noqa: E402

STAND_IN = """
import json, os, sys
from aiohttp import web
port = int(sys.argv[sys.argv.index("--port") + 1])
with open(os.environ["STAND_IN_RECORD"], "w") as f:
    json.dump({"argv": sys.argv, "env": dict(os.environ)}, f)
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "bench"}]})
app = web.Application()
app.router.add_get("/v1/models", models)
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


@pytest.fixture
def fake_vllm_env(tmp_path: Path) -> Path:
    """A 'venv' whose python runs this interpreter with a stand-in vllm package first on the
    path; returns the path of its bin/python."""
    package = tmp_path / "stub" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for level in (package, package.parent, package.parent.parent):
        (level / "__init__.py").write_text("")
    (package / "api_server.py").write_text(STAND_IN)
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "stub"}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


async def test_vllm_reference_is_started_tuned_waited_for_and_stopped(
    fake_vllm_env: Path, tmp_path: Path
) -> None:
    record = tmp_path / "record.json"
    server = VllmServer(
        str(fake_vllm_env), tmp_path / "model", free_port(),
        extra_env={"STAND_IN_RECORD": str(record)},
    )  # fmt: skip
    async with server:
        assert server.popen is not None and server.popen.poll() is None
        seen = orjson.loads(record.read_bytes())
    assert server.popen.poll() is not None  # stopped with its process group
    argv, env = seen["argv"], seen["env"]
    assert argv[0].endswith("vllm/entrypoints/openai/api_server.py")  # run as the module
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert "--no-enable-prefix-caching" in argv  # pdserve has no prefix cache either
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{(os.cpu_count() or 1) - 1}"
    assert "LD_PRELOAD" not in env  # this environment has no Intel OpenMP to preload


async def test_vllm_reference_that_exits_fails_fast_with_its_log(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho 'no module named vllm' >&2\nexit 3\n")
    python.chmod(0o755)
    server = VllmServer(str(python), tmp_path / "model", free_port())
    with pytest.raises(RuntimeError, match=r"vLLM exited \(3\)"):
        async with server:
            pass
    assert "no module named vllm" in server.log_path.read_text()


def test_tuned_env_preloads_the_environments_intel_openmp(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    assert tuned_env(str(python))["LD_PRELOAD"] == str(tmp_path / "venv" / "lib" / "libiomp5.so")


def test_report_gives_each_deployment_its_ratio_to_vllm_of_the_same_run() -> None:
    def run(tok_s: float) -> dict:
        return {"output_throughput": tok_s, "ttft_ms": {"p50": 10.0}, "tpot_ms": {"p50": 2.0}}

    results = {"pd": {8: run(240.0)}, "colocated": {8: run(260.0)}, "vllm": {8: run(200.0)}}
    rows = {r["deployment"]: r for r in pd_compare.report("small", results, [8])}
    assert rows["pd"]["x_vllm"] == pytest.approx(1.2)
    assert rows["colocated"]["x_vllm"] == pytest.approx(1.3)
    assert rows["vllm"]["x_vllm"] == pytest.approx(1.0)
    assert rows["pd"]["x_colocated"] == pytest.approx(240 / 260)
