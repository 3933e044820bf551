"""Failure-reason labels and the plain counters (pdserve/fsm/stats.py)."""

from __future__ import annotations

import orjson
import pytest

from pdserve.fsm import RoomStats, reason_key


@pytest.mark.parametrize(
    ("reason", "key"),
    [
        ("aborted", "aborted"),
        ("transfer_error: UCX ERR_UNREACHABLE", "transfer_error"),
        ("bootstrap_error:connection refused", "bootstrap_error"),
        ("peer_lost", "peer_lost"),
        ("timeout:Transferring", "timeout:Transferring"),
        ("timeout:Bootstrapping after 3 retries", "timeout:Bootstrapping"),
        ("", ""),
    ],
)
def test_reason_key_keeps_prefix_and_whole_timeouts(reason: str, key: str) -> None:
    assert reason_key(reason) == key


def test_stats_as_dict_is_json() -> None:
    stats = RoomStats(created=3, succeeded=1, failed=2)
    stats.rejected[("chunk_sent", "Gone")] = 4
    stats.failed_by_reason["aborted"] = 2
    decoded = orjson.loads(orjson.dumps(stats.as_dict()))
    assert decoded["rejected"] == {"chunk_sent@Gone": 4}
    assert decoded["failed_by_reason"] == {"aborted": 2}
    assert decoded["created"] == 3
    assert stats.num_rejected == 4
