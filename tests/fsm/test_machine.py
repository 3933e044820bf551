"""The shared, model-less room machine (pdserve/fsm/machine.py)."""

from __future__ import annotations

import itertools

import pytest
from transitions import Machine, MachineError

from pdserve.fsm import TRIGGERS, RoomSide, RoomState, build_room_machine
from pdserve.fsm.machine import LeanMachine, valid_triggers_by_state

EXPECTED = {
    ("Bootstrapping", "bootstrapped"): "WaitingForInput",
    ("Bootstrapping", "fail"): "Failed",
    ("WaitingForInput", "begin_transfer"): "Transferring",
    ("WaitingForInput", "fail"): "Failed",
    ("Transferring", "chunk_sent"): "Transferring",
    ("Transferring", "transfer_done"): "Success",
    ("Transferring", "fail"): "Failed",
}


class Model:
    __slots__ = ("state",)


def _place(machine: Machine, state: str) -> Model:
    model = Model()
    machine.set_state(state, model)
    return model


@pytest.mark.parametrize("lean", [True, False])
def test_machine_is_shared_and_has_no_auto_transitions(lean: bool) -> None:
    machine = build_room_machine(RoomSide.SENDER, lean=lean)
    assert machine.models == []  # model=None: rooms are never registered (no add_model)
    assert sorted(machine.events) == sorted(TRIGGERS)
    assert not any(name.startswith("to_") for name in machine.events)
    assert machine.auto_transitions is False
    assert machine.has_queue is False
    assert type(machine) is (LeanMachine if lean else Machine)


def test_terminal_states_accept_nothing() -> None:
    valid = valid_triggers_by_state(build_room_machine(RoomSide.RECEIVER))
    assert valid["Success"] == frozenset()
    assert valid["Failed"] == frozenset()
    assert valid["Transferring"] == {"chunk_sent", "transfer_done", "fail"}
    assert valid["Bootstrapping"] == {"bootstrapped", "fail"}
    assert valid["WaitingForInput"] == {"begin_transfer", "fail"}


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize(("state", "trigger"), list(itertools.product(RoomState, TRIGGERS)))
def test_graph_matches_spec(lean: bool, state: RoomState, trigger: str) -> None:
    machine = build_room_machine(RoomSide.SENDER, lean=lean)
    model = _place(machine, state.value)
    expected = EXPECTED.get((state.value, trigger))
    if expected is None:
        # Invalid here; the table screens these out, the library itself refuses them.
        with pytest.raises(MachineError):
            machine.events[trigger].trigger(model)
        assert model.state == state.value
    else:
        assert machine.events[trigger].trigger(model) is True
        assert model.state == expected


def test_lean_machine_defers_to_library_when_callbacks_exist() -> None:
    calls: list[str] = []
    machine = LeanMachine(
        model=None,
        states=["A", {"name": "B", "on_enter": lambda: calls.append("enter B")}],
        transitions=[
            {"trigger": "go", "source": "A", "dest": "B", "before": lambda: calls.append("before")},
            {
                "trigger": "stay",
                "source": "B",
                "dest": None,
                "after": lambda: calls.append("after"),
            },
            {"trigger": "blocked", "source": "B", "dest": "A", "conditions": lambda: False},
        ],
        initial="A",
        auto_transitions=False,
    )
    model = _place(machine, "A")
    assert machine.events["go"].trigger(model) is True
    assert machine.events["stay"].trigger(model) is True
    assert machine.events["blocked"].trigger(model) is False
    assert model.state == "B"
    assert calls == ["before", "enter B", "after"]


def test_lean_machine_runs_prepare_event_and_final_callbacks() -> None:
    calls: list[str] = []
    machine = LeanMachine(
        model=None,
        states=["A", {"name": "Z", "final": True}],
        transitions=[{"trigger": "end", "source": "A", "dest": "Z"}],
        initial="A",
        auto_transitions=False,
        prepare_event=lambda: calls.append("prepare"),
        on_final=lambda: calls.append("final"),
    )
    model = _place(machine, "A")
    assert machine.events["end"].trigger(model) is True
    assert calls == ["prepare", "final"]
    assert model.state == "Z"


def test_lean_machine_keeps_queued_processing() -> None:
    order: list[str] = []
    machine = LeanMachine(
        model=None,
        states=["A", "B", "C"],
        transitions=[
            {"trigger": "first", "source": "A", "dest": "B"},
            {"trigger": "second", "source": "B", "dest": "C"},
        ],
        initial="A",
        auto_transitions=False,
        queued=True,
        after_state_change=lambda: order.append("after"),
    )
    model = _place(machine, "A")

    def chain() -> None:
        # Queued: the nested trigger runs after the current transition completes.
        order.append("before second")
        machine.events["second"].trigger(model)
        order.append("queued")

    machine.events["first"].add_callback("before", chain)
    assert machine.events["first"].trigger(model) is True
    assert model.state == "C"
    assert order == ["before second", "queued", "after", "after"]


def test_lean_machine_runs_finalize_and_exception_hooks() -> None:
    seen: list[str] = []

    def boom(event: object) -> None:
        raise RuntimeError("callback failed")

    machine = LeanMachine(
        model=None,
        states=["A", "B"],
        transitions=[{"trigger": "go", "source": "A", "dest": "B", "before": boom}],
        initial="A",
        auto_transitions=False,
        send_event=True,
        finalize_event=lambda event: seen.append(f"final:{event.result}"),
        on_exception=lambda event: seen.append(f"error:{event.error}"),
    )
    model = _place(machine, "A")
    assert machine.events["go"].trigger(model) is False
    assert model.state == "A"
    assert seen == ["error:callback failed", "final:False"]
