"""Python embedding: a Server without HTTP, its in-process generate API and its metrics."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from pdserve import server as server_module
from pdserve.engine.config import EngineConfig
from pdserve.model.config import ModelDirError
from pdserve.model.demo import write_demo_model
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.server import Server, ServerConfig


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"))


def config(demo_dir: Path, **kw: object) -> ServerConfig:
    runner = RunnerConfig(model_dir=str(demo_dir), kv_cache_bytes=8 << 20)
    return ServerConfig(runner=runner, engine=EngineConfig(role="colocated"), **kw)


async def test_embedded_server_generates_text_chat_and_ids_without_http(demo_dir: Path):
    async with Server(config(demo_dir, serve_http=False)) as server:
        assert server.port is None
        for prompt in ("Hello", [{"role": "user", "content": "Hi"}], [1, 2, 3]):
            outs = [o async for o in server.generate(prompt, max_tokens=5, temperature=0,
                                                     ignore_eos=True)]  # fmt: skip
            assert outs[-1].finish_reason == "length"
            assert sum(len(o.token_ids) for o in outs) == 5
        text = "".join(
            [o.text async for o in server.generate("Hello", max_tokens=5, temperature=0)]
        )
        again = "".join(
            [o.text async for o in server.generate("Hello", max_tokens=5, temperature=0)]
        )
        assert text == again


async def test_embedded_server_metrics_are_zero_when_idle(demo_dir: Path):
    async with Server(config(demo_dir, serve_http=False)) as server:
        async for _ in server.generate("Hello", max_tokens=3, ignore_eos=True):
            pass
        text = generate_latest(server.registry).decode()
    for gauge in (
        "pdserve_waiting_requests",
        "pdserve_running_requests",
        "pdserve_prefill_inflight_requests",
        "pdserve_decode_waiting_for_kv_requests",
    ):
        assert f'{gauge}{{role="colocated"}} 0.0' in text  # fmt: skip
    assert 'pdserve_requests_total{role="colocated",status="length"} 1.0' in text
    total = next(line for line in text.splitlines() if line.startswith("pdserve_kv_pages_total"))
    free = next(line for line in text.splitlines() if line.startswith("pdserve_kv_pages_free"))
    cached = next(line for line in text.splitlines() if line.startswith("pdserve_kv_pages_cached"))
    assert float(total.split()[-1]) == float(free.split()[-1]) + float(cached.split()[-1])
    assert 'pdserve_kv_pages_used{role="colocated"} 0.0' in text


async def test_embedded_server_serves_http_when_asked(demo_dir: Path):
    import openai

    async with Server(config(demo_dir)) as server:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        resp = await client.completions.create(model="pdserve-demo", prompt="Hi", max_tokens=3)
        assert resp.usage.completion_tokens <= 3 and resp.choices[0].finish_reason


async def test_model_step_counters_grow_with_generation_and_threads_are_reported(demo_dir: Path):
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    def samples(server: Server) -> dict[tuple[str, str], float]:
        out = {}
        for family in text_string_to_metric_families(generate_latest(server.registry).decode()):
            for s in family.samples:
                if s.name.startswith(("pdserve_model_", "pdserve_torch_threads")):
                    out[(s.name, s.labels["phase"])] = s.value
        return out

    async with Server(config(demo_dir, serve_http=False)) as server:
        before = samples(server)  # warm-up (and thread calibration) steps are counted too
        async for _ in server.generate("Hello", max_tokens=6, temperature=0, ignore_eos=True):
            pass
        after = samples(server)
    assert (
        after[("pdserve_model_steps_total", "prefill")]
        == before[("pdserve_model_steps_total", "prefill")] + 1
    )
    assert (
        after[("pdserve_model_steps_total", "decode")]
        >= before[("pdserve_model_steps_total", "decode")] + 5
    )  # 6 tokens: the first from prefill, 5 decode steps
    assert (
        after[("pdserve_model_step_seconds_total", "decode")]
        > before[("pdserve_model_step_seconds_total", "decode")]
    )
    assert after[("pdserve_torch_threads", "prefill")] >= 1
    assert after[("pdserve_torch_threads", "decode")] >= 1


async def test_model_loads_on_the_thread_that_runs_its_steps(
    demo_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    # One thread does all torch work: a second OpenMP team slows every step (runner_thread.py).
    threads = {}

    class RecordingRunner(ModelRunner):
        def __init__(self, config: RunnerConfig) -> None:
            threads["load"] = threading.current_thread().name
            super().__init__(config)

        def decode(self, seqs):  # type: ignore[no-untyped-def]
            threads["decode"] = threading.current_thread().name
            return super().decode(seqs)

    monkeypatch.setattr(server_module, "ModelRunner", RecordingRunner)
    async with Server(config(demo_dir, serve_http=False)) as server:
        async for _ in server.generate("Hello", max_tokens=3, ignore_eos=True):
            pass
    assert threads["load"] == threads["decode"] == "pdserve-runner"
    assert threads["load"] != threading.current_thread().name


async def test_two_servers_sharing_a_cpu_lease_take_turns_and_report_it(
    demo_dir: Path, tmp_path: Path
):
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    lease = str(tmp_path / "cpu-lease")
    async with (
        Server(config(demo_dir, serve_http=False, cpu_lease_path=lease)) as a,
        Server(config(demo_dir, serve_http=False, cpu_lease_path=lease)) as b,
    ):

        async def run(server: Server) -> int:
            outs = [o async for o in server.generate("Hello", max_tokens=8, ignore_eos=True)]
            return sum(len(o.token_ids) for o in outs)

        assert await asyncio.gather(run(a), run(b)) == [8, 8]
        text = generate_latest(a.registry).decode()
    values = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("pdserve_cpu_lease_")
    }
    assert set(values) == {
        "pdserve_cpu_lease_wait_seconds_total",
        "pdserve_cpu_lease_contended_steps_total",
        "pdserve_cpu_lease_timeouts_total",
    }
    assert values["pdserve_cpu_lease_timeouts_total"] == 0
    assert a.engine is not None and a.engine.cpu_lease is not None
    assert a.engine.cpu_lease.stats.acquired > 8  # load, warm-up and every step held it


PLACEHOLDER = '"/path/to/model"'


def python_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of a docstring or a markdown file."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def embedding_examples() -> dict[str, str]:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Embedding in Python", 1)[1].split("\n## ", 1)[0]
    return {
        "pdserve/server.py": python_blocks(server_module.__doc__ or "")[0],
        "README.md": python_blocks(section)[0],
    }


@pytest.mark.parametrize("where", ["pdserve/server.py", "README.md"])
def test_the_embedding_example_runs_as_written(
    demo_dir: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    code = embedding_examples()[where]
    assert code.count(PLACEHOLDER) == 1, "the example names its model dir once"
    exec(compile(code.replace(PLACEHOLDER, repr(str(demo_dir))), where, "exec"), {})  # noqa: S102
    printed = capsys.readouterr().out
    assert printed  # greedy on the demo model: 16 tokens of (meaningless) text


async def test_a_quantized_checkpoint_fails_the_start_naming_its_method(
    demo_dir: Path, tmp_path: Path
) -> None:
    quantized = Path(shutil.copytree(demo_dir, tmp_path / "fp8"))
    hf = json.loads((quantized / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (quantized / "config.json").write_text(json.dumps(hf))
    with pytest.raises(
        ModelDirError, match=r"quantized \(quantization_config.quant_method 'fp8'\)"
    ):
        await Server(config(quantized)).start()
    assert not [t for t in threading.enumerate() if t.name == "pdserve-runner"]  # no leak


async def test_a_drain_waits_for_requests_in_flight_and_readiness_stays_off(demo_dir: Path):
    async with Server(config(demo_dir)) as server:
        stream = server.generate("Hello", max_tokens=40, ignore_eos=True)
        outs = [await anext(stream)]  # admitted and generating: the drain must wait for it
        drained = asyncio.create_task(server.drain("test"))
        outs += [o async for o in stream]
        assert await asyncio.wait_for(drained, 60) is True
        assert outs[-1].finish_reason == "length"
        assert sum(len(o.token_ids) for o in outs) == 40
        assert server.drain_gate.is_draining
        assert server.engine.load()["num_requests"] == 0


async def test_a_drain_past_its_timeout_ends_the_rest_with_drain_timeout(demo_dir: Path):
    from pdserve.engine.protocol import EngineError

    async with Server(config(demo_dir, serve_http=False, drain_timeout_s=0.01)) as server:
        budget = server.engine.info.max_model_len - 8  # far more than 0.01 s of decoding
        stream = server.generate("Hello", max_tokens=budget, ignore_eos=True)
        await anext(stream)
        assert await asyncio.wait_for(server.drain("test"), 30) is False
        await server.stop()
        with pytest.raises(EngineError) as failed:
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass
        assert failed.value.code == "drain_timeout" and failed.value.status == 503
