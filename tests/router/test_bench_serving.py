"""bench/serving.py against the router over worker doubles: it counts what really happened."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def serving():
    return load_bench("serving")


def test_prompts_are_deterministic_random_words_of_the_asked_length(serving):
    cfg = serving.BenchConfig(base_url="http://x:1", model="m", input_len=50, num_requests=3)
    prompts = serving.make_prompts(cfg)
    assert prompts == serving.make_prompts(cfg)
    assert len(set(prompts)) == 3 and all(len(p.split()) == 50 for p in prompts)
    other = serving.make_prompts(serving.BenchConfig(base_url="http://x:1", model="m", seed=1))
    assert other[0] != prompts[0]


def test_a_tokenizer_that_cannot_reach_the_input_length_is_an_error_not_a_memory_blowup(
    serving, tmp_path
):
    from tokenizers import Tokenizer, models

    # Word-level vocabulary without a pre-tokenizer: any prompt is one <unk> token.
    vocab = {"a": 0, "<unk>": 1}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    cfg = serving.BenchConfig(
        base_url="http://x:1", model="m", input_len=128, num_requests=1, tokenizer=str(tmp_path)
    )
    with pytest.raises(ValueError, match="cannot make 128-token prompts"):
        serving.make_prompts(cfg)


def test_payload_asks_for_exact_output_length(serving):
    cfg = serving.BenchConfig(
        base_url="http://x:1", model="m", output_len=7, endpoint="completions"
    )
    path, payload = serving.build_payload(cfg, "hello")
    assert path == "/v1/completions" and payload["prompt"] == "hello"
    assert payload["max_tokens"] == 7 and payload["ignore_eos"] is True and payload["stream"]


def test_goodput_counts_only_requests_within_slos(serving):
    cfg = serving.BenchConfig(base_url="http://x:1", model="m", slo_ttft_ms=100, slo_tpot_ms=10)
    fast = serving.RequestResult(is_ok=True, num_output_tokens=11, ttft_s=0.05, e2e_s=0.1)
    slow_first = serving.RequestResult(is_ok=True, num_output_tokens=11, ttft_s=0.2, e2e_s=0.25)
    slow_tokens = serving.RequestResult(is_ok=True, num_output_tokens=11, ttft_s=0.05, e2e_s=0.5)
    failed = serving.RequestResult(error="HTTP 503")
    summary = serving.summarize(cfg, [fast, slow_first, slow_tokens, failed], duration_s=2.0)
    assert summary["num_completed"] == 3 and summary["num_errors"] == 1
    assert summary["num_good"] == 1 and summary["goodput"] == 0.5
    assert summary["request_throughput"] == 1.5 and summary["output_throughput"] == 16.5
    assert math.isclose(summary["tpot_ms"]["p50"], 5.0)  # (e2e - ttft) / (tokens - 1)
    assert math.isclose(summary["tpot_ms"]["mean"], 55.0 / 3)


async def test_run_against_router_measures_every_request(
    serving, make_worker, make_router, tmp_path
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    decode.num_chunks = 5
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    cfg = serving.BenchConfig(
        base_url=router.url,
        model="fake-model",
        input_len=16,
        output_len=5,
        num_requests=12,
        request_rate=200.0,
        concurrency=4,
        num_warmup=1,
        json_out=str(tmp_path / "out.json"),
        png_out=str(tmp_path / "out.png"),
        is_progress_shown=False,
        max_duration_s=30,
    )
    summary = await serving.run_benchmark(cfg)
    assert summary["num_completed"] == 12 and summary["num_errors"] == 0
    assert len(decode.requests) == 13  # 12 + the warmup
    assert summary["mean_output_tokens"] == 5  # the double streams 5 chunks, no usage chunk
    assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["p99"] >= summary["itl_ms"]["p50"]
    saved = json.loads((tmp_path / "out.json").read_text())
    assert len(saved["requests"]) == 12 and len(saved["requests"][0]["itl_s"]) == 4
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"
    assert "TTFT" in serving.format_table(summary)


async def test_failed_requests_are_reported_as_errors(serving, make_worker, make_router):
    worker = await make_worker("colocated")
    router = await make_router(worker_urls=(worker.url,))
    worker.fail_status = 503
    cfg = serving.BenchConfig(
        base_url=router.url, model="m", num_requests=3, num_warmup=0, is_progress_shown=False,
        max_duration_s=30,
    )  # fmt: skip
    summary = await serving.run_benchmark(cfg)
    assert summary["num_errors"] == 3 and "HTTP 503" in summary["first_errors"][0]
