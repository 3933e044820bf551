"""Two checkpoints of one architecture with other weights (a base model and its fine-tune, as
far as a test goes: one tensor retouched) are not paired by a real router: the odd decode is
listed incompatible with its weights named, and requests go to the pair that matches."""

from __future__ import annotations

import shutil
from pathlib import Path

import aiohttp
from safetensors.torch import load_file, save_file

from tests.e2e.conftest import (
    assign_distinct_ports,
    fetch,
    get_json,
    router,
    scrape,
    wait_router_sees_every_worker,
    worker,
)

BODY = {"model": "demo", "prompt": "Which weights?", "max_tokens": 4, "ignore_eos": True}


def _tuned_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (weights,) = dst.glob("*.safetensors")
    tensors = load_file(str(weights))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.01
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return dst


async def test_a_decode_with_other_weights_is_not_paired(tmp_path: Path, demo_model_dir: Path):
    tuned = _tuned_copy(demo_model_dir, tmp_path / "tuned")
    prefill = worker(tmp_path, "prefill-0", "prefill", demo_model_dir)
    good = worker(tmp_path, "decode-0", "decode", demo_model_dir)
    odd = worker(tmp_path, "decode-tuned", "decode", tuned)
    rt = router(tmp_path, [prefill], [odd, good])
    procs = [prefill, odd, good, rt]
    assign_distinct_ports(procs)
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        async with aiohttp.ClientSession() as s:
            # Until the others have answered a probe the first decode seen is the fleet: judge
            # only a fully probed fleet.
            await wait_router_sees_every_worker(s, rt.url)
            listed = {w["url"]: w for w in (await get_json(s, f"{rt.url}/workers"))["data"]}
            assert listed[odd.url]["weights"] != listed[good.url]["weights"]
            assert listed[odd.url]["compatible"] is False
            assert "weights" in listed[odd.url]["compatibility_error"]
            assert listed[good.url]["compatible"] and listed[prefill.url]["compatible"]
            for _ in range(4):  # round robin over the decodes would reach the odd one
                status, raw = await fetch(s, "POST", f"{rt.url}/v1/completions", BODY)
                assert status == 200, raw
            served = {p.name: (await scrape(s, p.url)).total("pdserve_requests_total") for p in
                      (good, odd)}  # fmt: skip
        assert served == {"decode-0": 4, "decode-tuned": 0}
    finally:
        for p in reversed(procs):
            p.stop()
