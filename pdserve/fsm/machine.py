"""The room lifecycle as a ``transitions`` machine, one per room kind, shared by all its rooms.

Built with ``model=None`` and triggered through ``machine.events[name].trigger(room)``: a
Machine per room (or ``add_model``, which keeps a list it searches linearly) would cost tens of
microseconds and hundreds of bytes per room for nothing, since the graph is identical.
"""

from __future__ import annotations

import logging

from transitions import Event, EventData, Machine, Transition

from pdserve.fsm.room import TERMINAL_STATES, RoomSide, RoomState

BOOTSTRAPPED = "bootstrapped"
BEGIN_TRANSFER = "begin_transfer"
CHUNK_SENT = "chunk_sent"
TRANSFER_DONE = "transfer_done"
FAIL = "fail"
TRIGGERS: tuple[str, ...] = (BOOTSTRAPPED, BEGIN_TRANSFER, CHUNK_SENT, TRANSFER_DONE, FAIL)

_B = RoomState.BOOTSTRAPPING.value
_W = RoomState.WAITING_FOR_INPUT.value
_T = RoomState.TRANSFERRING.value
_S = RoomState.SUCCESS.value
_F = RoomState.FAILED.value

TRANSITIONS: tuple[dict[str, object], ...] = (
    {"trigger": BOOTSTRAPPED, "source": _B, "dest": _W},
    {"trigger": BEGIN_TRANSFER, "source": _W, "dest": _T},
    # Internal transition (dest None): progress is counted but the state, and its deadline, stay.
    {"trigger": CHUNK_SENT, "source": _T, "dest": None},
    {"trigger": TRANSFER_DONE, "source": _T, "dest": _S},
    {"trigger": FAIL, "source": [_B, _W, _T], "dest": _F},
)


class LeanTransition(Transition):
    """``Transition`` minus the library's per-step logging and walks over empty callback lists.

    Room lives cost ~9 us per trigger in stock ``transitions`` 0.9.3, mostly in DEBUG/INFO log
    calls and callback plumbing that our machine never configures; this halves it. Semantics are
    the library's: whenever any callback or condition is configured we defer to the stock path,
    and the state is still written by ``Machine.set_state``.
    """

    def execute(self, event_data: EventData) -> bool:
        machine = event_data.machine
        if (
            self.prepare
            or self.conditions
            or self.before
            or self.after
            or machine.before_state_change
            or machine.after_state_change
        ):
            return super().execute(event_data)
        if self.dest:  # None: internal transition, no state change
            self._change_state(event_data)
        return True

    def _change_state(self, event_data: EventData) -> None:
        machine = event_data.machine
        source = machine.states[self.source]
        dest = machine.states[self.dest]
        if source.on_exit or dest.on_enter or (dest.final and machine.on_final):
            return super()._change_state(event_data)
        machine.set_state(dest, event_data.model)
        event_data.state = dest
        return None


class LeanEvent(Event):
    """``Event`` dispatch without the partial/queue hop, empty hook walks and log lines.

    Defers to the library whenever a queue or an event-level hook is configured.
    """

    def trigger(self, model: object, *args: object, **kwargs: object) -> bool:
        if self.machine.has_queue:
            return super().trigger(model, *args, **kwargs)
        # Unqueued Machine._process just calls the partial; build the EventData directly.
        event_data = EventData(None, self, self.machine, model, args=args, kwargs=kwargs)
        return self._trigger(event_data)

    def _trigger(self, event_data: EventData) -> bool:
        machine = self.machine
        if machine.finalize_event or machine.on_exception:
            return super()._trigger(event_data)
        event_data.state = machine.get_model_state(event_data.model)
        if self._is_valid_source(event_data.state):  # raises MachineError when invalid
            self._process(event_data)
        return event_data.result

    def _process(self, event_data: EventData) -> None:
        if self.machine.prepare_event:
            return super()._process(event_data)
        for transition in self.transitions[event_data.state.name]:
            event_data.transition = transition
            if transition.execute(event_data):
                event_data.result = True
                break
        return None


class LeanMachine(Machine):
    """A stock synchronous ``Machine`` using :class:`LeanTransition` and :class:`LeanEvent`."""

    transition_cls = LeanTransition
    event_cls = LeanEvent


def build_room_machine(side: RoomSide, *, lean: bool = True) -> Machine:
    """A model-less machine for rooms of ``side``. Success and Failed have no way out.

    ``lean=False`` builds the stock ``transitions.Machine`` (same graph; the bench compares).
    """
    _quiet_transitions_logger()
    states = [{"name": s.value, "final": s.value in TERMINAL_STATES} for s in RoomState]
    machine_cls = LeanMachine if lean else Machine
    return machine_cls(
        model=None,
        states=states,
        transitions=[dict(t) for t in TRANSITIONS],
        initial=RoomState.BOOTSTRAPPING.value,
        auto_transitions=False,
        send_event=False,
        ignore_invalid_triggers=False,  # the table screens triggers first; a miss here is a bug
        name=f"room-{side.value}",
    )


def valid_triggers_by_state(machine: Machine) -> dict[str, frozenset[str]]:
    """Which triggers each state accepts, read back from the machine (terminal states: none)."""
    valid: dict[str, set[str]] = {name: set() for name in machine.states}
    for name, event in machine.events.items():
        for source in event.transitions:
            valid[source].add(name)
    return {state: frozenset(names) for state, names in valid.items()}


def _quiet_transitions_logger() -> None:
    # transitions logs several INFO lines per trigger ("Finished processing state ... callbacks");
    # at one room per request that would drown the service log. Our table logs every transition
    # itself, so cap the library at WARNING unless someone configured its logger explicitly.
    lib_logger = logging.getLogger("transitions")
    if lib_logger.level == logging.NOTSET:
        lib_logger.setLevel(logging.WARNING)
