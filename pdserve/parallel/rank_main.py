"""``python -m pdserve.parallel.rank_main``: tensor-parallel rank r > 0 of one engine.

Started by rank 0 (pdserve.parallel.ranks) with the engine's runner config; builds its own
:class:`~pdserve.model_runner.ModelRunner` on its shard, then runs every step rank 0 sends on
stdin, in order, until the pipe ends. It samples nothing and answers nothing: its only
outputs are its K/V writes into its own pool and its part of each collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from pdserve.parallel.ranks import RankLaunch
from pdserve.parallel.step_wire import StepKind, read_step
from pdserve.runner_config import RunnerConfig

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.parallel.rank_main")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--run-dir", required=True, help="rank 0's run dir (store, gather region)")
    p.add_argument("--shm-slot-bytes", type=int, default=0, help="0: gather over gloo")
    p.add_argument("--config", required=True, help="the engine's RunnerConfig as JSON")
    p.add_argument("--log-level", type=int, default=logging.INFO, help="rank 0's, as a number")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(name)s: %(message)s",
    )
    fields = {f.name for f in dataclasses.fields(RunnerConfig)}
    config = RunnerConfig(**{k: v for k, v in json.loads(args.config).items() if k in fields})
    from pdserve.model_runner import ModelRunner  # after logging: its import loads torch

    runner = ModelRunner(config, RankLaunch(args.rank, args.run_dir, args.shm_slot_bytes))
    stream = sys.stdin.buffer
    steps = 0
    while (step := read_step(stream)).kind != StepKind.EXIT:
        runner.follow(step)
        steps += 1
    logger.info("tensor-parallel rank %d: %d steps, pipe closed: exiting", args.rank, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
