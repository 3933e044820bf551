"""bench/workloads.py: the shapes of the shared-prefix and multi-turn prompt sets."""

from __future__ import annotations

import pytest

from bench.workloads import make_prompts


def test_prefix_repetition_groups_share_their_prefix_and_nothing_else():
    prompts = make_prompts("prefix_repetition", 8, 5, num_prefixes=4, prefix_len=30)
    words = [p.split() for p in prompts]
    assert all(len(w) == 35 for w in words)
    assert all(words[i][:30] == words[i + 4][:30] for i in range(4))
    assert len({" ".join(w[:30]) for w in words}) == 4
    assert len({" ".join(w[30:]) for w in words}) == 8  # unique tails


def test_multi_turn_resends_the_conversation_so_far_turn_major():
    prompts = make_prompts("multi_turn", 6, 3, num_turns=3, output_len=2)
    assert len(prompts) == 6  # 2 conversations x 3 turns
    first, second = prompts[0], prompts[2]  # conversation 0, turns 0 and 1
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[0] == first[0] and len(second[1]["content"].split()) == 2
    assert prompts[4][:3] == second and len(prompts[4]) == 5  # turn 2 extends turn 1


def test_unknown_dataset_is_an_error():
    with pytest.raises(ValueError, match="dataset"):
        make_prompts("nope", 1, 1)
