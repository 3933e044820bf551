"""router/load.py: parsing a worker's load report, scoring it, and the admission decision."""

from __future__ import annotations

import pytest

from pdserve.router.load import (
    WorkerLoad,
    admission_refusal,
    backlog_refusal,
    load_score,
    output_budget,
    refusal,
)


def _load(**fields: object) -> WorkerLoad:
    base = {"free_pages": 100, "page_size": 16, "num_requests": 0}
    parsed = WorkerLoad.from_json({**base, **fields})
    assert parsed is not None
    return parsed


def test_a_report_parses_and_a_missing_one_is_none() -> None:
    load = _load(waiting=2, waiting_for_kv=1, running=3, num_requests=6, draining=True)
    assert (load.queued, load.running, load.free_pages, load.draining) == (3, 3, 100, True)
    assert WorkerLoad.from_json(None) is None


@pytest.mark.parametrize(
    "raw", ["x", {"free_pages": -1}, {"waiting": 1.5}, {"page_size": 0}, {"running": "2"}]
)
def test_a_malformed_report_is_refused(raw: object) -> None:
    with pytest.raises(ValueError):
        WorkerLoad.from_json(raw)


def test_the_score_takes_the_larger_count_then_prefers_free_pages() -> None:
    assert load_score(1, _load(num_requests=5)) == (5, -100)
    assert load_score(7, _load(num_requests=5)) == (7, -100)
    assert load_score(2, _load(free_pages=10)) > load_score(2, _load(free_pages=90))
    assert load_score(3, None) == (3, 0)


def test_the_output_budget_is_max_completion_tokens_else_max_tokens() -> None:
    assert output_budget({"max_tokens": 40, "prompt": "a long text"}) == 40
    assert output_budget({"max_completion_tokens": 8, "max_tokens": 99}) == 8
    assert output_budget({"max_tokens": "9"}) == 0


def test_the_output_budget_reads_max_output_tokens_and_counts_each_prompt_of_a_batch() -> None:
    assert output_budget({"input": "hi", "max_output_tokens": 30}) == 30
    assert output_budget({"input": "hi", "max_output_tokens": True}) == 0
    assert output_budget({"prompt": [[1, 2], [3]], "max_tokens": 10}) == 20
    assert output_budget({"prompt": ["a", "b", "c"], "max_tokens": 4}) == 12
    assert output_budget({"prompt": [1, 2, 3], "max_tokens": 4}) == 4


def test_a_worker_refuses_when_draining_queued_over_the_limit_or_short_of_pages() -> None:
    assert refusal(_load(), 160, max_queue=8) is None
    assert refusal(_load(draining=True), 1, max_queue=8) == "draining"
    assert "queued" in (refusal(_load(waiting=5, waiting_for_kv=3), 1, max_queue=8) or "")
    assert "KV pages" in (refusal(_load(free_pages=3), 16 * 3 + 1, max_queue=8) or "")
    assert refusal(_load(free_pages=3), 16 * 3, max_queue=8) is None
    assert refusal(None, 10**6, max_queue=1) is None  # no report: never refused on a guess
    # More than the whole cache: the worker refuses it with a 400, not the router with a 429.
    assert refusal(_load(free_pages=3, total_pages=10), 16 * 11, max_queue=8) is None
    assert refusal(_load(free_pages=3, total_pages=10), 16 * 10, max_queue=8) is not None


def test_admission_refuses_only_when_every_worker_refuses() -> None:
    full, free = _load(free_pages=0), _load()
    assert admission_refusal([full, free], 16, max_queue=8) is None
    assert "KV pages" in (admission_refusal([full, full], 16, max_queue=8) or "")
    assert admission_refusal([], 16, max_queue=8) is None  # no worker: the dispatcher's 503


def test_a_report_carries_the_prompt_tokens_queued_for_prefill() -> None:
    assert _load(waiting_prompt_tokens=4096).waiting_prompt_tokens == 4096
    assert _load().waiting_prompt_tokens == 0  # an older worker that does not say
    with pytest.raises(ValueError, match="waiting_prompt_tokens"):
        WorkerLoad.from_json({"waiting_prompt_tokens": -1})


def test_an_idle_prefill_takes_any_prompt_and_a_busy_one_up_to_its_backlog_limit() -> None:
    assert backlog_refusal(0, 10**6, max_backlog=1000) is None
    assert backlog_refusal(600, 400, max_backlog=1000) is None
    assert "600 prompt tokens queued" in (backlog_refusal(600, 401, max_backlog=1000) or "")


def test_a_strict_check_refuses_what_could_never_fit() -> None:
    # An upper bound on a prompt's size that overflows the cache says nothing for sure.
    load = _load(free_pages=3, total_pages=10)
    assert refusal(load, 16 * 11, max_queue=8) is None
    assert refusal(load, 16 * 11, max_queue=8, is_strict=True) is not None
    assert admission_refusal([load], 16 * 11, 8, is_strict=True) is not None
