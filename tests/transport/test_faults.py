"""Fault plans: validated, reproducible by seed, counted."""

from __future__ import annotations

import pytest

from pdserve.fsm import RoomDeadlines, RoomState
from pdserve.transport.faults import FaultPlan, maybe_injector
from tests.transport.conftest import HB, Endpoints, outcome

LOCAL = "127.0.0.1"


def test_probabilities_outside_unit_interval_are_rejected() -> None:
    with pytest.raises(ValueError, match="drop_notif_prob"):
        FaultPlan(drop_notif_prob=1.5)
    with pytest.raises(ValueError, match="delay_s"):
        FaultPlan(delay_s=-1)
    with pytest.raises(ValueError, match="drop_peer_after_n"):
        FaultPlan(drop_peer_after_n=0)


def test_same_seed_gives_the_same_fault_sequence() -> None:
    plan = FaultPlan(drop_notif_prob=0.5, fail_transfer_prob=0.3, seed=7)
    a, b = plan.injector(), plan.injector()
    seq_a = [(a.should_drop_notif(), a.should_fail_transfer()) for _ in range(200)]
    seq_b = [(b.should_drop_notif(), b.should_fail_transfer()) for _ in range(200)]
    assert seq_a == seq_b
    drops = sum(d for d, _ in seq_a)
    assert 60 < drops < 140  # roughly half, and certainly not all or none
    assert a.stats.notifs_dropped == drops


def test_no_plan_means_no_injector_and_zero_probabilities_never_fire() -> None:
    assert maybe_injector(None) is None
    inj = FaultPlan().injector()
    assert not any(inj.should_drop_notif() or inj.should_fail_transfer() for _ in range(100))
    assert inj.chunk_delay_s() == 0.0


def test_peer_is_dropped_after_n_successes_per_peer() -> None:
    inj = FaultPlan(drop_peer_after_n=3).injector()
    assert [inj.should_drop_peer("a") for _ in range(3)] == [False, False, True]
    assert inj.should_drop_peer("b") is False  # counted per peer
    assert [inj.should_drop_peer("a") for _ in range(3)] == [False, False, True]
    assert inj.stats.peers_dropped == 2


def test_delay_is_counted_each_time_it_applies() -> None:
    inj = FaultPlan(delay_s=0.25).injector()
    assert inj.chunk_delay_s() == 0.25 and inj.chunk_delay_s() == 0.25
    assert inj.stats.delays == 2


# -- the plan applied by a real sender/receiver pair -------------------------------------------


async def test_failed_transfer_fails_both_rooms_and_frees_pages_by_ack(
    endpoints: Endpoints,
) -> None:
    sender, s_rel = await endpoints.sender(faults=FaultPlan(fail_transfer_prob=1.0))
    receiver, r_rel = await endpoints.receiver()
    s_room = sender.open_room("f", "req")
    room = await receiver.open_room("f", "req", LOCAL, sender.bootstrap_port, [3, 4], 20)
    assert sender.send("f", [1, 2], 20, first_token=0)
    out = await outcome(s_room)
    assert out.state == RoomState.FAILED and out.reason.startswith("transfer_error: fault")
    assert await s_rel.wait("f") == [1, 2]
    # The decode learns from its next heartbeat that the prefill forgot it.
    out = await outcome(room, within_s=3 * HB + 1.0)
    assert out.state == RoomState.FAILED and out.reason.startswith("peer_lost")
    assert await r_rel.wait("f") == [3, 4]
    assert receiver.stats["released_by_ack"] == 1  # the sender is alive: it acked
    assert sender.stats["fault_transfers_failed"] == 1 and sender.stats["transfer_errors"] == 1


async def test_dropped_data_notification_ends_the_room_by_deadline(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender()
    deadlines = RoomDeadlines(bootstrapping_s=2.0, waiting_for_input_s=0.5, transferring_s=2.0)
    plan = FaultPlan(drop_notif_prob=1.0)
    receiver, r_rel = await endpoints.receiver(deadlines=deadlines, faults=plan)
    s_room = sender.open_room("n", "req")
    room = await receiver.open_room("n", "req", LOCAL, sender.bootstrap_port, [5], 10)
    assert sender.send("n", [6], 10, first_token=0)
    assert (await outcome(s_room)).state == RoomState.SUCCESS  # the data did land
    assert (await outcome(room)).reason == "timeout:WaitingForInput"
    assert await r_rel.wait("n") == [5]
    assert receiver.stats["notifs_dropped"] == 1


async def test_dropped_peer_reregisters_and_the_next_room_works(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender(faults=FaultPlan(drop_peer_after_n=1))
    receiver, _ = await endpoints.receiver()
    for room_id in ("p1", "p2"):
        s_room = sender.open_room(room_id, "req")
        room = await receiver.open_room(room_id, "req", LOCAL, sender.bootstrap_port, [1], 10)
        assert sender.send(room_id, [2], 10, first_token=1)
        assert (await outcome(room, within_s=3.0)).state == RoomState.SUCCESS
        # The receiver can see the data before the sender's write completion reaches its loop;
        # the sender counts the drop right after its own room's Success, so wait for that.
        assert (await outcome(s_room, within_s=3.0)).state == RoomState.SUCCESS
    stats = sender.stats
    assert stats["fault_peers_dropped"] == 2 and stats["peers_lost"] == 2
    assert stats["peers_registered"] == 2
