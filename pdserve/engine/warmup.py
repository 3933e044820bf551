"""Engine start-up work on the runner thread: a real one-token generation, then (decode and
colocated roles on a CPU, see ``thread_tuning.should_calibrate``) the decode thread-count
measurement of pdserve.thread_tuning."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pdserve.kernels.kv_cache import PageAllocator
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence
from pdserve.thread_tuning import CALIBRATION_BATCH

if TYPE_CHECKING:
    from pdserve.engine.runner_thread import RunnerThread
    from pdserve.model_runner import ModelRunner

logger = logging.getLogger(__name__)


async def warm_up(
    runner: ModelRunner,
    allocator: PageAllocator,
    runner_thread: RunnerThread,
    *,
    calibrate: bool,
    max_num_seqs: int,
    engine_id: str,
) -> None:
    """Prove the model works; measure decode threads when ``calibrate``. Scratch pages are
    allocated from (and returned to) ``allocator`` before any request is admitted."""
    bos = runner.tokenizer.bos_token_id or 0
    seq = Sequence("warmup", [bos], 1, SamplingParams(max_tokens=1))
    seq.page_ids = allocator.allocate(1)
    try:
        await runner_thread.submit(runner.prefill, [seq])
    finally:
        allocator.free(seq.page_ids)
    if not calibrate:
        return
    num_tokens = runner.calibration_tokens
    pages_each = runner.kv_config.pages_for(num_tokens)
    num_seqs = min(CALIBRATION_BATCH, max_num_seqs, allocator.num_available // pages_each)
    if num_seqs < 1:
        return
    seqs = [
        Sequence(f"calibrate-{i}", [bos] * (num_tokens - 1), num_tokens - 1,
                 SamplingParams(temperature=0.0), allocator.allocate(pages_each))
        for i in range(num_seqs)
    ]  # fmt: skip
    try:
        choice = await runner_thread.submit(runner.calibrate_decode_threads, seqs)
    finally:
        for s in seqs:
            allocator.free(s.page_ids)
    logger.info("%s (batch %d): %s", engine_id, num_seqs, choice.describe())
