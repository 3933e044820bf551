"""bench/llamacpp_ref.py builds llama.cpp once into its cache and reuses the build, converts
checkpoints to GGUF once, and runs llama-server with issue 21's settings; bench/pd_compare.py
puts each ``--llamacpp`` file beside pdserve. No build here: the commands are recorded by a
stand-in runner that leaves what the real ones would, and a stand-in script plays llama-server."""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import tarfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import orjson
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import llamacpp_ref, pd_compare  # noqa: E402
from bench.cluster import free_port  # noqa: E402
from bench.llamacpp_ref import LlamaCppTree, LlamaServer, ensure_build, write_gguf  # noqa: E402


class FakeToolchain:
    """Records commands; a `cmake --build` leaves the two binaries, a conversion its output."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []
        self.fetched: list[str] = []

    def fetch(self, version: str, dest: Path) -> None:
        self.fetched.append(version)
        dest.mkdir(parents=True)
        (dest / "CMakeLists.txt").write_text("project(llama.cpp)\n")

    def run(self, argv: Sequence[str], cwd: Path) -> None:
        argv = list(argv)
        self.commands.append(argv)
        if "--build" in argv:
            bin_dir = Path(argv[argv.index("--build") + 1]) / "bin"
            bin_dir.mkdir(parents=True, exist_ok=True)
            for name in llamacpp_ref.TARGETS:
                (bin_dir / name).write_text("#!/bin/sh\n")
        elif "--outfile" in argv:
            Path(argv[argv.index("--outfile") + 1]).write_bytes(b"GGUF bf16")
        elif argv[-1] in llamacpp_ref.QUANTIZE_TYPES:
            Path(argv[-2]).write_bytes(f"GGUF {argv[-1].lower()}".encode())


def test_build_fetches_configures_and_builds_niced_then_a_second_call_reuses_it(
    tmp_path: Path,
) -> None:
    tools = FakeToolchain()
    tree = ensure_build("9.9.9", tmp_path, run=tools.run, fetch=tools.fetch)
    assert tree.root == tmp_path / "9.9.9" and tools.fetched == ["9.9.9"]
    configure, build = tools.commands
    assert configure[:3] == ["nice", "-n", "19"] and build[:3] == ["nice", "-n", "19"]
    assert "-DGGML_NATIVE=ON" in configure and "-DLLAMA_OPENSSL=OFF" in configure
    assert f"-DCMAKE_CXX_FLAGS={llamacpp_ref.NO_AMX}" in configure  # its AMX matmul crashes
    assert configure[configure.index("-S") + 1] == str(tree.src)
    assert build[build.index("-j") + 1] == "2"
    assert build[build.index("--target") + 1 :] == ["llama-server", "llama-quantize"]
    assert tree.is_built()

    again = FakeToolchain()
    assert ensure_build("9.9.9", tmp_path, run=again.run, fetch=again.fetch) == tree
    assert again.commands == [] and again.fetched == []


def test_a_build_without_its_stamp_is_rebuilt_on_the_source_already_there(
    tmp_path: Path,
) -> None:
    tools = FakeToolchain()
    tree = ensure_build("9.9.9", tmp_path, run=tools.run, fetch=tools.fetch)
    tree.stamp.unlink()  # as after a build interrupted between the binaries and the stamp
    again = FakeToolchain()
    ensure_build("9.9.9", tmp_path, run=again.run, fetch=again.fetch)
    assert again.fetched == [] and len(again.commands) == 2
    assert tree.is_built()


def test_a_build_made_by_other_commands_is_not_reused(tmp_path: Path) -> None:
    tools = FakeToolchain()
    tree = ensure_build("9.9.9", tmp_path, run=tools.run, fetch=tools.fetch)
    tree.stamp.write_text(orjson.dumps({"commands": [["cmake", "-DGGML_NATIVE=OFF"]]}).decode())
    assert not tree.is_built()
    again = FakeToolchain()
    ensure_build("9.9.9", tmp_path, run=again.run, fetch=again.fetch)
    assert len(again.commands) == 2 and tree.is_built()


def _tree_and_hf_dir(tmp_path: Path) -> tuple[LlamaCppTree, Path]:
    hf_dir = tmp_path / "models" / "smol-hf"
    hf_dir.mkdir(parents=True)
    return LlamaCppTree(tmp_path / "llamacpp"), hf_dir


def test_q8_0_is_quantized_from_the_bf16_conversion_and_both_are_cached(tmp_path: Path) -> None:
    tree, hf_dir = _tree_and_hf_dir(tmp_path)
    tools = FakeToolchain()
    q8 = write_gguf(tree, hf_dir, "Q8_0", run=tools.run)
    convert, quantize = tools.commands
    assert convert[3:5] == [sys.executable, str(tree.convert_script)]
    assert convert[convert.index("--outtype") + 1] == "bf16"
    assert quantize[3:] == [str(tree.quantize), str(hf_dir.parent / "smol-hf.BF16.gguf"),
                            str(q8) + ".part", "Q8_0"]  # fmt: skip
    assert q8 == hf_dir.parent / "smol-hf.Q8_0.gguf" and q8.read_bytes() == b"GGUF q8_0"
    again = FakeToolchain()
    assert write_gguf(tree, hf_dir, "Q8_0", run=again.run) == q8
    assert write_gguf(tree, hf_dir, "BF16", run=again.run).read_bytes() == b"GGUF bf16"
    assert again.commands == []
    with pytest.raises(ValueError, match="Q4_K_M"):  # the file types are named
        write_gguf(tree, hf_dir, "Q4_K", run=again.run)


def test_a_k_quant_mix_is_quantized_from_the_same_bf16_conversion(tmp_path: Path) -> None:
    tree, hf_dir = _tree_and_hf_dir(tmp_path)
    tools = FakeToolchain()
    q4km = write_gguf(tree, hf_dir, "Q4_K_M", run=tools.run)
    assert tools.commands[-1][-1] == "Q4_K_M" and q4km.read_bytes() == b"GGUF q4_k_m"
    assert llamacpp_ref.gguf_label(q4km) == "Q4_K_M"
    again = FakeToolchain()
    write_gguf(tree, hf_dir, "Q6_K", run=again.run)
    assert len(again.commands) == 1  # the BF16 file is reused


def test_only_the_vendored_llama_cpp_is_taken_from_the_sdist(tmp_path: Path) -> None:
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in [("llama_cpp_python-9.9.9/vendor/llama.cpp/CMakeLists.txt", b"cmake"),
                           ("llama_cpp_python-9.9.9/vendor/llama.cpp/tools/server/a.cpp", b"c"),
                           ("llama_cpp_python-9.9.9/llama_cpp/llama.py", b"python")]:  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    llamacpp_ref.extract_source(sdist, "9.9.9", tmp_path / "src")
    found = sorted(str(p.relative_to(tmp_path / "src")) for p in (tmp_path / "src").rglob("*.*"))
    assert found == ["CMakeLists.txt", "tools/server/a.cpp"]
    with pytest.raises(RuntimeError, match="vendor/llama.cpp"):
        llamacpp_ref.extract_source(sdist, "1.0.0", tmp_path / "other")


def test_an_sdist_whose_sha256_is_not_pinned_is_refused_before_it_is_unpacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_pip(argv: list[str], **kwargs: object) -> None:
        dest = Path(argv[argv.index("-d") + 1])
        (dest / f"llama_cpp_python-{llamacpp_ref.VERSION}.tar.gz").write_bytes(b"not the pin")

    monkeypatch.setattr(llamacpp_ref.subprocess, "run", fake_pip)
    with pytest.raises(RuntimeError, match="refused, SHA-256 mismatch: got [0-9a-f]{64}, pinned"):
        llamacpp_ref.download_source(llamacpp_ref.VERSION, tmp_path / "src")
    assert list(tmp_path.iterdir()) == []  # nothing unpacked, no temporary directory left
    with pytest.raises(RuntimeError, match="has no pinned SHA-256"):
        llamacpp_ref.check_pinned(tmp_path / "x.tar.gz", "0.0.1")
    pinned = tmp_path / "ok.tar.gz"
    pinned.write_bytes(b"bytes")
    monkeypatch.setitem(llamacpp_ref.SDIST_SHA256, "0.0.1", hashlib.sha256(b"bytes").hexdigest())
    llamacpp_ref.check_pinned(pinned, "0.0.1")  # the pinned bytes pass


STAND_IN = """#!{python}
import json, os, sys
from aiohttp import web
port = int(sys.argv[sys.argv.index("--port") + 1])
with open({record!r}, "w") as f:
    json.dump(sys.argv, f)
async def health(request):
    return web.json_response({{"status": "ok"}})
app = web.Application()
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


async def test_llama_server_runs_with_the_issues_settings_and_is_stopped(tmp_path: Path) -> None:
    record = tmp_path / "argv.json"
    binary = tmp_path / "llama-server"
    binary.write_text(STAND_IN.format(python=sys.executable, record=str(record)))
    binary.chmod(0o755)
    server = LlamaServer(binary, tmp_path / "m.Q4_1.gguf", free_port())
    async with server:
        assert server.popen is not None and server.popen.poll() is None
        argv = orjson.loads(record.read_bytes())
    assert server.popen.poll() is not None  # stopped with its process group
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert flags["-m"] == str(tmp_path / "m.Q4_1.gguf")
    assert (flags["-np"], flags["-c"], flags["-t"]) == ("8", "8192", "2")
    assert flags["--host"] == "127.0.0.1" and flags["--alias"] == "bench"
    assert "--no-cache-prompt" in argv  # pd_compare repeats its prompts: no reuse
    assert argv[argv.index("--cache-ram") + 1] == "0"


async def test_llama_server_that_exits_fails_fast_with_its_log(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'failed to load model' >&2\nexit 1\n")
    binary.chmod(0o755)
    server = LlamaServer(binary, tmp_path / "missing.gguf", free_port())
    with pytest.raises(RuntimeError, match=r"llama-server exited \(1\)"):
        async with server:
            pass
    assert "failed to load model" in server.log_path.read_text()


def test_gguf_label_is_the_weight_type_in_the_file_name() -> None:
    assert llamacpp_ref.gguf_label(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "Q4_1"
    assert llamacpp_ref.gguf_label(Path("x/smol-hf.BF16.gguf")) == "BF16"
    assert llamacpp_ref.gguf_label(Path("model.gguf")) == "model"


def parse_pd_compare(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The namespace pd_compare.main hands to run_all for ``argv``."""
    seen: list[argparse.Namespace] = []

    async def fake_run_all(args: argparse.Namespace) -> list[dict]:
        seen.append(args)
        return []

    monkeypatch.setattr(pd_compare, "run_all", fake_run_all)
    assert pd_compare.main(argv) == 0
    return seen[0]


def test_pd_compare_passes_the_llamacpp_files_and_threads_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = parse_pd_compare(
        ["--config", "smollm2", "--llamacpp", "/m/a.Q4_1.gguf,Q8_0", "--llamacpp-threads", "1"],
        monkeypatch,
    )
    assert (args.configs, args.llamacpp, args.llamacpp_threads) == (
        ["smollm2"], "/m/a.Q4_1.gguf,Q8_0", 1,
    )  # fmt: skip
    assert parse_pd_compare([], monkeypatch).llamacpp is None  # off unless asked


async def test_pd_compare_serves_each_llamacpp_file_beside_pdserve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = LlamaCppTree(tmp_path / "llamacpp")
    hf_dir = tmp_path / "hf"
    monkeypatch.setattr(llamacpp_ref, "run_command", FakeToolchain().run)
    monkeypatch.setattr(llamacpp_ref, "ensure_build", lambda: tree)
    served: list[Path] = []

    async def fake_bench(tree_: LlamaCppTree, gguf: Path, model_dir: Path, a: object) -> dict:
        assert tree_ == tree and model_dir == hf_dir  # the client tokenizes with pdserve's
        served.append(gguf)
        return {1: {"output_throughput": 10.0, "num_errors": 1, "num_requests": 16}}

    monkeypatch.setattr(pd_compare, "bench_llamacpp", fake_bench)
    args = argparse.Namespace(
        deps=[], configs=["smollm2"], conc=[1], model_dir=str(hf_dir), vllm_python=None,
        llamacpp="/m/a.Q4_1.gguf,Q8_0,bf16", same_file=True, feature_variants=[],
    )  # fmt: skip
    rows = await pd_compare.run_all(args)
    assert served == [Path("/m/a.Q4_1.gguf"), tmp_path / "hf.Q8_0.gguf", tmp_path / "hf.BF16.gguf"]
    assert [r["deployment"] for r in rows] == ["llamacpp-Q4_1", "llamacpp-Q8_0", "llamacpp-BF16"]
    assert all(r["errors"] == 1 and r["num_requests"] == 16 for r in rows)


def test_ratio_lines_compare_pdserve_with_each_llamacpp_file_of_the_same_run() -> None:
    def row(dep: str, conc: int, tok_s: float, tpot: float | None = None) -> dict:
        return {"config": "smollm2", "deployment": dep, "concurrency": conc, "tok_s": tok_s,
                "tpot_p50_ms": tpot}  # fmt: skip

    rows = [row("pd", 8, 150.0), row("colocated", 8, 120.0), row("llamacpp-Q4_1", 8, 100.0, 20.0),
            row("colocated-Q4_1", 8, 130.0, 15.0), row("colocated-Q8_0", 8, 999.0)]  # fmt: skip
    assert pd_compare.ratio_lines(rows, pd_compare.LLAMACPP_PREFIX) == [
        "smollm2 c8: pd / llamacpp-Q4_1 throughput, same run: 1.50",
        "smollm2 c8: colocated / llamacpp-Q4_1 throughput, same run: 1.20",
        "smollm2 c8: colocated-Q4_1 / llamacpp-Q4_1 throughput, same run: 1.30; "
        "TPOT p50 15.0 vs 20.0 ms",
    ]


async def test_pdserve_serves_each_llamacpp_file_beside_llama_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[tuple[str, Path]] = []

    def fake(kind: str) -> Callable[..., Awaitable[dict]]:
        async def bench(*a: object, **_: object) -> dict:  # (model_dir, args[, model]) / ...
            model = a[1] if kind == "llamacpp" else (a[2] if len(a) > 2 else a[0])
            served.append((kind, Path(str(model))))
            return {1: {"output_throughput": 10.0, "num_errors": 0, "num_requests": 16}}

        return bench

    monkeypatch.setattr(pd_compare, "bench_pd", fake("pd"))
    monkeypatch.setattr(pd_compare, "bench_colocated", fake("colocated"))
    monkeypatch.setattr(pd_compare, "bench_llamacpp", fake("llamacpp"))
    monkeypatch.setattr(pd_compare.llamacpp_ref, "ensure_build", lambda: None)
    args = argparse.Namespace(
        deps=["colocated"], configs=["smollm2"], conc=[1], model_dir=str(tmp_path),
        vllm_python=None, llamacpp="/m/a.Q4_1.gguf", same_file=True, feature_variants=[],
    )  # fmt: skip
    rows = await pd_compare.run_all(args)
    assert served == [("colocated", tmp_path), ("colocated", Path("/m/a.Q4_1.gguf")),
                      ("llamacpp", Path("/m/a.Q4_1.gguf"))]  # fmt: skip
    assert [r["deployment"] for r in rows] == ["colocated", "colocated-Q4_1", "llamacpp-Q4_1"]


COMPLETION_STAND_IN = """#!{python}
import sys
from aiohttp import web
port = int(sys.argv[sys.argv.index("--port") + 1])
async def health(request):
    return web.json_response({{"status": "ok"}})
async def completion(request):
    body = await request.json()
    assert body["temperature"] == 0.0 and body["ignore_eos"] and body["return_tokens"]
    assert not body["cache_prompt"]
    ids = body["prompt"]  # token ids in; its continuation: the ids reversed, then 0s
    tokens = (ids[::-1] + [0] * body["n_predict"])[: body["n_predict"] + 2]
    return web.json_response({{"content": "", "tokens": tokens}})
app = web.Application()
app.router.add_get("/health", health)
app.router.add_post("/completion", completion)
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


async def test_fidelity_asks_llama_server_for_greedy_token_ids_on_the_same_prompts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import fidelity

    binary = tmp_path / "llama-server"
    binary.write_text(COMPLETION_STAND_IN.format(python=sys.executable))
    binary.chmod(0o755)
    monkeypatch.setattr(llamacpp_ref, "ensure_build", lambda: LlamaCppTree(tmp_path))
    monkeypatch.setattr(LlamaCppTree, "server", property(lambda _self: binary))
    got = await fidelity.llamacpp_greedy(tmp_path / "m.Q4_1.gguf", [[5, 6, 7], [9]], 4)
    assert got == [[7, 6, 5, 0], [9, 0, 0, 0]]  # n tokens each, in the server's order
    assert fidelity.score("llama.cpp", got, [[7, 6, 1, 1], [9, 0, 0, 0]]).mean_agreeing_tokens == 3


def test_llama_server_argv_carries_the_speculation_flags(tmp_path: Path) -> None:
    plain = LlamaServer(tmp_path / "llama-server", tmp_path / "t.gguf", 1234).argv()
    assert "--spec-type" not in plain and "--model-draft" not in plain
    draft = LlamaServer(
        tmp_path / "llama-server", tmp_path / "t.gguf", 1234, spec_type="draft-simple",
        model_draft=tmp_path / "d.gguf", draft_max=4,
    ).argv()  # fmt: skip
    assert draft[draft.index("--spec-type") + 1] == "draft-simple"
    assert draft[draft.index("--model-draft") + 1] == str(tmp_path / "d.gguf")
    assert draft[draft.index("--spec-draft-n-max") + 1] == "4"
    ngram = LlamaServer(tmp_path / "s", tmp_path / "t.gguf", 1, spec_type="ngram-simple").argv()
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-simple"
