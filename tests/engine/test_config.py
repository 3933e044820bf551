"""Engine configuration: the request deadlines that bound every state."""

from __future__ import annotations

import pytest

from pdserve.engine.config import RequestDeadlines


def test_the_overall_deadline_is_derived_from_the_tokens_unless_given() -> None:
    derived = RequestDeadlines(request_base_s=10.0, request_per_token_s=0.5)
    assert derived.overall_s(100) == 60.0
    assert RequestDeadlines(request_s=7.0).overall_s(100) == 7.0
    assert RequestDeadlines().overall_s(0) == RequestDeadlines().request_base_s > 0


@pytest.mark.parametrize("bad", [dict(request_s=0.0), dict(request_per_token_s=-1.0)])
def test_a_deadline_that_cannot_bound_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="deadline"):
        RequestDeadlines(**bad)
