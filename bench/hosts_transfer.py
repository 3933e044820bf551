"""KV transfer rate between two hosts: one prefill and one decode, each on its own network
namespace (bench/hosts.py), NIXL over UCX's TCP transport on the veths. Sends prompts of
``--prompt-tokens`` one at a time and reports the prefill's ``pdserve_kv_transfer_*``
histograms (bytes / seconds from a room's first WRITE posted to its last done) and the bytes the
kernel counted on the decode host's interface. Needs root (``ip netns``).

    sudo python bench/hosts_transfer.py --prompt-tokens 2000 --requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from anywhere

from bench.cluster import ClusterSpec  # noqa: E402
from bench.hosts import hosts_cluster, kv_transfer_rate, ucx_transports  # noqa: E402
from bench.netns import unavailable_reason  # noqa: E402

REQUEST_TIMEOUT_S = 300.0


async def measure(spec: ClusterSpec, prompt_tokens: int, num_requests: int) -> dict:
    """Figures of ``num_requests`` sequential requests of about ``prompt_tokens`` tokens."""
    async with hosts_cluster(spec) as cluster:
        [decode] = cluster.decodes
        rx_before = cluster.fabric.link_bytes(decode.name).rx
        prompt = " ".join(f"w{i % 97}" for i in range(prompt_tokens // 2))  # ~2 tokens a word
        body = {"model": spec.served_model_name, "prompt": prompt, "max_tokens": 1}
        for _ in range(num_requests):
            async with cluster.session.post(
                f"{cluster.router.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S
            ) as resp:
                usage = (await resp.json())["usage"]
                if resp.status != 200:
                    raise RuntimeError(f"request failed: {resp.status}")
        rate = await kv_transfer_rate(cluster.session, cluster.prefills)
        lanes = ucx_transports(cluster.prefills[0].log_path)
        rx = cluster.fabric.link_bytes(decode.name).rx - rx_before
    return {**asdict(rate), "gb_per_s": round(rate.gb_per_s, 4),
            "prompt_tokens": usage["prompt_tokens"], "decode_link_rx_bytes": rx,
            "ucx": {k: sorted(v) for k, v in lanes.items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--model", default=None, help="model dir (default: the built-in demo)")
    p.add_argument("--kv-cache-mb", type=int, default=256)
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"hosts_transfer: {reason}", file=sys.stderr)
        return 2
    from pdserve.cli_common import resolve_model_dir

    base = ClusterSpec(model_dir=str(resolve_model_dir(args.model)))
    worker_args = [a for a in base.worker_args]
    worker_args[worker_args.index("--kv-cache-mb") + 1] = str(args.kv_cache_mb)
    spec = ClusterSpec(model_dir=base.model_dir, worker_args=tuple(worker_args))
    print(json.dumps(asyncio.run(measure(spec, args.prompt_tokens, args.requests))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
