"""Real clients against pdserve, unchanged: guidellm, aiperf, instructor, langchain-openai,
openai-agents and lm-eval, on a colocated worker and on a ``pdserve up`` PD cluster.

Creates its own venv under the bench cache (~/.cache/pdserve/bench/clients-venv; the clients are
not pdserve dependencies; the venv sees pdserve's venv for torch and transformers, which
lm-eval's ``hf`` backend needs), starts each target, runs each client's standard flow
(bench/client_flows.py), prints a matrix and exits non-zero on any failure. ``--record DIR``
puts a recording proxy in front of the target and saves the first request body of each flow
(what tests/e2e/test_clients.py replays).

    python bench/clients.py                       # the demo model, both targets, every flow
    python bench/clients.py --model DIR --flows instructor,lm_eval --targets pd
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from anywhere
from bench import clients_proxy  # noqa: E402
from pdserve.envs import env_with_pythonpath  # noqa: E402

CACHE = Path.home() / ".cache" / "pdserve" / "bench"
VENV = CACHE / "clients-venv"
PINS = ("guidellm==0.8.1", "aiperf==0.13.0", "instructor==1.17.0", "langchain-openai==1.7.4",
        "openai-agents==0.24.0", "lm-eval==0.4.13")  # fmt: skip
FLOWS = ("guidellm", "aiperf", "instructor", "langchain", "agents", "lm_eval")
TARGETS = ("colocated", "pd")
READY_TIMEOUT_S = 600.0
FLOW_TIMEOUT_S = 1800.0
HERE = Path(__file__).resolve().parent


def ensure_venv() -> Path:
    """The clients' venv, created and installed once (a marker names what it holds)."""
    marker = VENV / ".pdserve-pins"
    if marker.is_file() and marker.read_text() == "\n".join(PINS):
        return VENV / "bin" / "python"
    subprocess.run([sys.executable.replace(sys.prefix, sys.base_prefix), "-m", "venv",
                    "--clear", str(VENV)], check=True)  # fmt: skip
    site = next((VENV / "lib").glob("python3*/site-packages"))
    base = next((Path(sys.prefix) / "lib").glob("python3*/site-packages"))
    (site / "zz_pdserve_base.pth").write_text(f"{base}\n")  # torch, transformers: not again
    python = VENV / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], check=True)
    marker.write_text("\n".join(PINS))
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name}: exited {proc.returncode}\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)  # a readiness poll with a deadline
    raise TimeoutError(f"{url} not ready after {READY_TIMEOUT_S:g}s")


@contextmanager
def target(kind: str, model_dir: str, name: str, work: Path, dtype: str) -> Iterator[str]:
    """A colocated worker or a ``pdserve up`` cluster; yields its base URL."""
    port = free_port()
    common = ["--model", model_dir, "--served-model-name", name, "--dtype", dtype]
    if kind == "colocated":
        argv = ["serve", "--role", "colocated", "--port", str(port), *common]
    else:
        argv = ["up", "--router-port", str(port), "--prefill-port", str(free_port()),
                "--decode-port", str(free_port()), "--bootstrap-port", str(free_port()),
                *common]  # fmt: skip
    log = work / f"server-{kind}.log"
    env = env_with_pythonpath(str(HERE.parent))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *argv],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc, log)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def run_flow(
    python: Path, flow: str, url: str, a: argparse.Namespace, label: str
) -> dict[str, Any]:
    argv = [str(python), str(HERE / "client_flows.py"), flow, "--base-url", f"{url}/v1",
            "--model", a.served_name, "--model-dir", a.model_dir, "--work-dir", str(a.work_dir),
            "--label", label] + (["--is-demo"] if a.is_demo else [])  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=FLOW_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "detail": f"timed out after {FLOW_TIMEOUT_S:g}s"}
    (a.work_dir / f"{flow}-{label}.stderr").write_text(done.stderr)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"ok": False, "detail": f"no result (exit {done.returncode}): {done.stderr[-300:]}"}
    return json.loads(lines[-1])


def compare_lm_eval(work: Path) -> dict[str, Any]:
    """PD's per-item loglikelihoods against the colocated worker's: equal bit for bit."""
    files = [work / f"lm_eval_{t}.json" for t in TARGETS]
    if not all(f.is_file() for f in files):
        return {"ok": False, "detail": "needs lm_eval on both targets"}
    colo, pd = (json.loads(f.read_text()) for f in files)
    pairs = [(c[0], p[0]) for ci, pi in zip(colo["pdserve_mc"], pd["pdserve_mc"], strict=True)
             for c, p in zip(ci, pi, strict=True)]  # fmt: skip
    num_equal = sum(c == p for c, p in pairs)
    diff = max(abs(float(c) - float(p)) for c, p in pairs)
    return {"ok": num_equal == len(pairs), "detail": f"{num_equal}/{len(pairs)} loglikelihoods "
            f"equal, max abs diff {diff:.1e}"}  # fmt: skip


def format_matrix(results: dict[tuple[str, str], dict[str, Any]], targets: list[str]) -> str:
    rows = sorted(
        {flow for flow, _ in results}, key=lambda f: (FLOWS + ("lm_eval pd==colocated",)).index(f)
    )
    lines = ["| client | " + " | ".join(targets) + " |", "|---" * (len(targets) + 1) + "|"]
    for flow in rows:
        cells = []
        for t in targets:
            r = results.get((flow, t))
            cells.append("" if r is None else f"{'ok' if r['ok'] else 'FAIL'}: {r['detail']}")
        lines.append(f"| {flow} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: the demo model)")
    p.add_argument("--served-name", default="demo")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--flows", default=",".join(FLOWS))
    p.add_argument("--work-dir", type=Path, default=CACHE / "clients-run")
    p.add_argument("--record", type=Path, default=None, help="save each flow's request bodies")
    p.add_argument("--dtype", default="float32", help="targets' --dtype (hf: float32)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.work_dir.mkdir(parents=True, exist_ok=True)
    a.is_demo = a.model is None
    if a.model is None:
        a.model = str(CACHE / "demo-model")
        subprocess.run([sys.executable, "-m", "pdserve", "make-demo-model", a.model], check=True)
    a.model_dir = a.model
    python = ensure_venv()
    targets = a.targets.split(",")
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for kind in targets:
        with target(kind, a.model_dir, a.served_name, a.work_dir, a.dtype) as url:
            for flow in a.flows.split(","):
                with clients_proxy.maybe_recording(url, a.record, flow, kind) as client_url:
                    results[(flow, kind)] = run_flow(python, flow, client_url, a, kind)
                print(f"{kind:9} {flow:10} {results[(flow, kind)]}", flush=True)
    if "lm_eval" in a.flows and set(TARGETS) <= set(targets):
        results[("lm_eval pd==colocated", "pd")] = compare_lm_eval(a.work_dir)
    print(format_matrix(results, targets))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
