"""Leg helpers: spotting an error as a stream's first event."""

from __future__ import annotations

from pdserve.router.legs import CLIENT_ERROR_STATUSES, UpstreamReply, first_event_error


def test_first_event_error_detects_openai_error_objects_only():
    err = b'data: {"error": {"message": "timeout:waiting_for_kv", "type": "timeout"}}\n\n'
    assert first_event_error(err + b"data: [DONE]\n\n") == "timeout:waiting_for_kv"
    chunk = b'data: {"id": "x", "choices": [{"delta": {"content": "error"}}]}\n\n'
    assert first_event_error(chunk + err) is None  # only the first event counts
    assert first_event_error(b"data: [DONE]\n\n") is None
    assert first_event_error(b": keep-alive comment\n\n") is None
    assert first_event_error(b"data: {broken json\n\n") is None
    assert first_event_error(b'event: x\ndata: {"error": "plain"}\n\n') == "plain"


def test_client_error_statuses_are_the_ones_never_retried():
    assert (
        {s for s in range(400, 600) if UpstreamReply(s, b"", "").is_client_error}
        == set(CLIENT_ERROR_STATUSES)
        == {400, 404, 413, 422}
    )
