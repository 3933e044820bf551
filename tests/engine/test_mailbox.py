"""OutputMailbox: one waiter, deltas merged when the consumer is behind, errors never merged."""

from __future__ import annotations

import asyncio

from pdserve.engine.mailbox import OutputMailbox, merge_outputs
from pdserve.engine.protocol import EngineError, GenerateOutput, TokenLogprob


def delta(
    tok: int, text: str, n: int, finish: str | None = None, lp: bool = False
) -> GenerateOutput:
    logprobs = [TokenLogprob(tok, -0.5)] if lp else None
    return GenerateOutput("r", [tok], text, 3, n, finish, logprobs)


async def test_get_waits_for_the_next_put() -> None:
    box = OutputMailbox()
    getter = asyncio.create_task(box.get())
    await asyncio.sleep(0)  # let the getter park on its waiter
    assert not getter.done()
    box.put(delta(7, "a", 1))
    out = await asyncio.wait_for(getter, 5)
    assert out.token_ids == [7] and out.text == "a"


async def test_a_consumer_behind_gets_one_merged_delta() -> None:
    box = OutputMailbox()
    for i, ch in enumerate("abc"):
        box.put(delta(10 + i, ch, i + 1, finish="length" if ch == "c" else None))
    out = await box.get()
    assert out.token_ids == [10, 11, 12] and out.text == "abc"
    assert out.num_generated_tokens == 3 and out.finish_reason == "length"
    assert len(box) == 0


async def test_error_is_delivered_after_the_deltas_queued_before_it() -> None:
    box = OutputMailbox()
    box.put(delta(1, "x", 1))
    box.put(delta(2, "y", 2))
    box.put(EngineError("peer lost", 503))
    first = await box.get()
    assert isinstance(first, GenerateOutput) and first.text == "xy"
    second = await box.get()
    assert isinstance(second, EngineError) and second.message == "peer lost"


async def test_deltas_with_and_without_logprobs_are_not_merged() -> None:
    box = OutputMailbox()
    box.put(delta(1, "x", 1, lp=False))
    box.put(delta(2, "y", 2, lp=True))
    box.put(delta(3, "z", 3, lp=True))
    first, second = await box.get(), await box.get()
    assert first.token_ids == [1] and first.logprobs is None
    assert second.token_ids == [2, 3] and [lp.token_id for lp in second.logprobs] == [2, 3]


def test_merge_keeps_the_last_counters_and_stop_reason() -> None:
    a, b = delta(1, "he", 1), delta(2, "llo", 2, finish="stop")
    b.stop_reason = "lo"
    merged = merge_outputs([a, b])
    assert merged.text == "hello" and merged.stop_reason == "lo" and merged.num_prompt_tokens == 3
