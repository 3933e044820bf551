"""PD hand-offs: what the prefill hand-off gives the sender after a prefill."""

from __future__ import annotations

from typing import Any

from pdserve.engine.handoff import PrefillHandoff
from pdserve.engine.protocol import KVTransferParams
from pdserve.engine.request import Request, RequestState
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence


class _Marker:
    def query(self) -> bool:
        return False


class _Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def send(self, *args: Any) -> bool:
        self.sent.append(args)
        return True


class _Engine:
    class config:  # noqa: N801 - stands in for EngineConfig
        class deadlines:  # noqa: N801
            prefill_inflight_s = 5.0

    def __init__(self) -> None:
        self.armed: list[str] = []

    def arm(self, req: Request, seconds: float, label: str) -> None:
        self.armed.append(label)


def test_prefilled_pages_go_to_the_sender_with_the_steps_kv_marker() -> None:
    sender, engine = _Sender(), _Engine()
    handoff = PrefillHandoff(engine, sender)  # type: ignore[arg-type]
    seq = Sequence("r", [1, 2, 3], 3, SamplingParams(), [4, 5])
    req = Request("r", seq, KVTransferParams("room", "127.0.0.1", 1))
    marker = _Marker()
    assert handoff.on_prefilled(req, 9, None, marker)
    (args,) = sender.sent
    assert args[:4] == ("room", [4, 5], 3, 9) and args[-1] is marker
    assert req.state is RequestState.PREFILL_INFLIGHT and seq.page_ids == []
    assert engine.armed == ["timeout:inflight"]
