"""The cache_aware policy as a pure class: prefix affinity, load balance, bounded trees."""

from __future__ import annotations

import random

from pdserve.router.cache_aware import (
    CacheAwareConfig,
    CacheAwarePolicy,
    PrefixTrees,
    routing_text,
)
from pdserve.router.policies import make_policy
from pdserve.router.workers import ServerInfoMsg
from tests.router.test_policies import workers
from tests.router.test_workers import INFO

SYSTEM = "You are a helpful assistant. " * 20  # ~580 characters shared by every request


def test_requests_sharing_a_prefix_follow_the_first_one():
    ws = workers(0, 0, 0)
    policy = CacheAwarePolicy()
    first = policy.choose(ws, SYSTEM + "question one")
    first.num_in_flight += 1
    again = [policy.choose(ws, SYSTEM + f"question {i}") for i in range(5)]
    assert all(w is first for w in again)


def test_unrelated_prompts_spread_over_the_least_loaded_workers():
    ws = workers(0, 0, 0)
    policy = CacheAwarePolicy()
    chosen = []
    for i in range(3):
        w = policy.choose(ws, f"{i} " * 200)
        w.num_in_flight += 1
        chosen.append(w.url)
    assert sorted(chosen) == sorted(w.url for w in ws)


def test_a_hot_prefix_moves_to_an_idle_worker_past_the_load_threshold():
    ws = workers(0, 0)
    policy = CacheAwarePolicy(CacheAwareConfig(balance_abs=4, balance_rel=1.5))
    home = policy.choose(ws, SYSTEM)
    home.num_in_flight = 4  # within the threshold: affinity wins
    assert policy.choose(ws, SYSTEM) is home
    home.num_in_flight = 5  # 5 - 0 > 4 and 5 > 0 * 1.5: imbalanced
    other = policy.choose(ws, SYSTEM)
    assert other is not home
    other.num_in_flight = 3  # now both hold the prefix: the less loaded of them
    assert policy.choose(ws, SYSTEM) is other


def test_load_other_routers_sent_counts_against_a_prefix_holder():
    # The holder looks idle to this router (nothing in flight from it), but it reports 9
    # requests of another router's: past the threshold the idle worker gets the prefix.
    ws = workers(0, 0)
    policy = CacheAwarePolicy(CacheAwareConfig(balance_abs=4, balance_rel=1.5))
    home = policy.choose(ws, SYSTEM)
    assert policy.choose(ws, SYSTEM) is home
    home.info = _reporting(num_requests=9, free_pages=100)
    assert policy.choose(ws, SYSTEM) is not home
    # With no prefix to follow, equal request counts go to the worker with more free pages.
    home.info = _reporting(num_requests=0, free_pages=100)
    other = next(w for w in ws if w is not home)
    other.info = _reporting(num_requests=0, free_pages=10)
    assert policy.choose(ws, "unrelated " * 50) is home


def _reporting(**load: int) -> ServerInfoMsg:
    return ServerInfoMsg.from_json({**INFO, "load": load})


def test_a_short_shared_part_below_the_cache_threshold_is_routed_by_load():
    ws = workers(0, 0)
    policy = CacheAwarePolicy(CacheAwareConfig(cache_threshold=0.5, chunk_chars=8))
    home = policy.choose(ws, "A" * 64)
    home.num_in_flight = 1
    assert policy.choose(ws, "A" * 16 + "B" * 48) is not home  # 2 of 8 chunks: 25%
    assert policy.choose(ws, "A" * 48 + "B" * 16) is home  # 6 of 8 chunks: 75%


def test_no_text_means_least_loaded():
    ws = workers(3, 1, 2)
    assert CacheAwarePolicy().choose(ws, None) is ws[1]


def test_each_workers_tree_is_bounded_and_forgets_least_recently_routed_first():
    trees = PrefixTrees(CacheAwareConfig(chunk_chars=4, max_chunks_per_worker=4))
    old, new = trees.chunk_keys("aaaabbbb"), trees.chunk_keys("ccccdddd")
    trees.insert("w", old)
    trees.insert("w", new)
    assert trees.size("w") == 4
    trees.insert("w", trees.chunk_keys("eeee"))
    assert trees.size("w") == 4
    assert trees.matched("w", old) == 0 and trees.matched("w", new) == 2


def test_chunk_keys_name_the_whole_prefix_not_just_the_chunk():
    trees = PrefixTrees(CacheAwareConfig(chunk_chars=4))
    trees.insert("w", trees.chunk_keys("aaaabbbb"))
    assert trees.matched("w", trees.chunk_keys("ccccbbbb")) == 0
    assert trees.matched("w", trees.chunk_keys("aaaabbbbcccc")) == 2


def test_routing_text_of_chat_and_completion_bodies():
    parts = [{"type": "text", "text": "hi"}]
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": parts}]}
    assert routing_text(chat) == "<system>S<user>hi"
    assert routing_text({"prompt": "abc"}) == "abc"
    assert routing_text({"prompt": ["first", "second"]}) == "first"
    assert routing_text({"prompt": [1, 2, 3]}) == "1,2,3"
    assert routing_text({"prompt": [[4, 5], [6]]}) == "4,5"
    assert routing_text({"prompt": ""}) is None and routing_text({}) is None


def test_a_responses_body_routes_by_the_same_key_as_its_chat():
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}
    parts = [{"type": "input_text", "text": "h"}, {"type": "input_text", "text": "i"}]
    for body in ({"instructions": "S", "input": "hi"},
                 {"input": [{"role": "developer", "content": "S"},
                            {"role": "user", "content": parts}]}):  # fmt: skip
        assert routing_text(body) == routing_text(chat) == "<system>S<user>hi"
    assert routing_text({"input": []}) is None


def test_make_policy_knows_cache_aware():
    assert make_policy("cache_aware", random.Random(0)).name == "cache_aware"
