"""The replica router without Ray: the approximate radix tree (agentrt/scaleout/radix.py) and its
memory bound, routing keys (routing_key.py), the policies with their load threshold and counters
(policy.py), and the merged /metrics (metrics.py)."""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentrt.scaleout.metrics import merge_replica_metrics
from agentrt.scaleout.policy import RoutingConfig, RoutingTable
from agentrt.scaleout.radix import ChunkRadixTree
from agentrt.scaleout.routing_key import RouteKey, chunk_ids, route_key, routing_text

# ---- the tree -------------------------------------------------------------------------------


def test_match_counts_leading_chunks_and_splits_edges():
    tree = ChunkRadixTree(100)
    assert tree.match([1, 2, 3]) == 0
    assert tree.insert([1, 2, 3, 4]) == 4
    assert tree.match([1, 2, 3, 4, 5]) == 4
    assert tree.match([1, 2, 9]) == 2
    assert tree.match([2, 1]) == 0
    assert tree.insert([1, 2, 7]) == 1  # splits the edge after [1, 2]
    assert tree.num_chunks == 5 == tree.count_chunks()
    assert tree.num_nodes == 4  # root, [1, 2], [3, 4], [7]
    assert tree.match([1, 2, 7, 8]) == 3
    assert tree.match([1, 2, 3, 4]) == 4
    assert tree.insert([1, 2]) == 0  # already held
    assert tree.num_chunks == 5


def test_match_does_not_change_what_eviction_removes():
    tree = ChunkRadixTree(10)
    tree.insert([1, 2, 3, 4])  # oldest
    tree.insert([5, 6, 7, 8])
    for _ in range(5):
        assert tree.match([1, 2, 3, 4]) == 4  # a match is not a use
    tree.insert([9, 10, 11])  # 11 > 10: evict LRU leaves down to 9
    assert tree.match([1, 2, 3, 4]) == 0
    assert tree.match([5, 6, 7, 8]) == 4
    assert tree.match([9, 10, 11]) == 3


def test_insert_refreshes_the_whole_path():
    tree = ChunkRadixTree(12)
    tree.insert([1, 2, 3, 4])
    tree.insert([5, 6, 7, 8])
    tree.insert([1, 2, 3, 4])  # [1..4] is now the most recent
    tree.insert([9, 10, 11, 12, 13])  # over the bound: [5..8] goes
    assert tree.match([5, 6, 7, 8]) == 0
    assert tree.match([1, 2, 3, 4]) == 4
    assert tree.match([9, 10, 11, 12, 13]) == 5


def test_ten_thousand_distinct_prefixes_stay_within_the_bound():
    bound = 5000
    tree = ChunkRadixTree(bound)
    rng = random.Random(0)
    shared = [rng.getrandbits(64) for _ in range(20)]  # a common preamble, like a shared system prompt
    keys = []
    for i in range(10_000):
        head = shared[: rng.randrange(0, 21)]
        key = head + [rng.getrandbits(64) for _ in range(rng.randrange(1, 40))]
        keys.append(key)
        tree.insert(key)
        assert tree.num_chunks <= bound, i
        assert tree.num_nodes <= tree.num_chunks + 1
    assert tree.count_chunks() == tree.num_chunks
    assert tree.num_evicted_chunks > 0
    assert tree.match(keys[-1]) == len(keys[-1])  # the newest is kept whole
    assert tree.match(keys[0]) <= 20  # the oldest's own chunks are gone (the preamble may remain)


def test_a_key_longer_than_the_bound_keeps_its_head():
    tree = ChunkRadixTree(8)
    tree.insert(list(range(100)))
    assert tree.num_chunks == 8
    assert tree.match(list(range(100))) == 8


def test_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_chunks must be >= 1"):
        ChunkRadixTree(0)


# ---- routing keys ---------------------------------------------------------------------------

SYSTEM_A = "You are agent A. " * 50
SYSTEM_B = "You are agent B. " * 50


def chat(system: str, *turns: str, salt: str | None = None, tools: list | None = None) -> dict:
    body: dict = {"model": "m", "messages": [{"role": "system", "content": system}]}
    for i, t in enumerate(turns):
        body["messages"].append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    if salt is not None:
        body["cache_salt"] = salt
    if tools is not None:
        body["tools"] = tools
    return body


def test_a_longer_conversation_extends_the_key():
    short = routing_text("/v1/chat/completions", chat(SYSTEM_A, "hi"))
    longer = routing_text("/v1/chat/completions", chat(SYSTEM_A, "hi", "hello", "more"))
    assert longer.startswith(short)
    a, b = chunk_ids(short, 64), chunk_ids(longer, 64)
    assert a[: len(short) // 64] == b[: len(short) // 64]


def test_the_salt_comes_first_so_salted_keys_share_nothing():
    one = route_key("/v1/chat/completions", chat(SYSTEM_A, "hi", salt="tenant-1"), 16)
    two = route_key("/v1/chat/completions", chat(SYSTEM_A, "hi", salt="tenant-2"), 16)
    plain = route_key("/v1/chat/completions", chat(SYSTEM_A, "hi"), 16)
    assert one.chunk_ids[0] != two.chunk_ids[0] != plain.chunk_ids[0]
    tree = ChunkRadixTree(1000)
    tree.insert(one.chunk_ids)
    assert tree.match(two.chunk_ids) == 0
    assert tree.match(plain.chunk_ids) == 0


def test_tools_are_part_of_the_key():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tool = routing_text("/v1/chat/completions", chat(SYSTEM_A, "hi", tools=[tool]))
    without = routing_text("/v1/chat/completions", chat(SYSTEM_A, "hi"))
    assert '"name":"f"' in with_tool and '"name":"f"' not in without


def test_every_prompt_route_has_a_key_and_the_others_none():
    assert "prompt:The capital" in routing_text("/v1/completions", {"prompt": "The capital"})
    assert "prompt:a" in routing_text("/v1/completions", {"prompt": ["a", "b"]})
    assert "prompt:[1,2]" in routing_text("/v1/completions", {"prompt": [1, 2]})
    responses = routing_text("/v1/responses", {"instructions": "be brief", "input": "hi"})
    assert "system:be brief" in responses and "msg:hi" in responses
    messages = routing_text(
        "/v1/messages", {"system": "be brief", "messages": [{"role": "user", "content": "x"}]}
    )
    assert "system:be brief" in messages and '"content":"x"' in messages
    assert routing_text("/v1/models", {}) is None
    assert routing_text("/v1/chat/completions", ["not", "an", "object"]) is None
    assert route_key("/tokenize", {"prompt": "x"}, 64) is None
    with pytest.raises(ValueError, match="chunk_chars must be >= 1"):
        chunk_ids("abc", 0)


# ---- policies -------------------------------------------------------------------------------


def key_of(body: dict, chunk_chars: int = 64) -> RouteKey:
    return route_key("/v1/chat/completions", body, chunk_chars)


def test_prefix_keeps_each_agent_on_its_replica():
    table = RoutingTable(RoutingConfig(policy="prefix"))
    table.update_replicas({"r0": None, "r1": None})
    placed = {"A": set(), "B": set()}
    for turn in range(8):
        for agent, system in (("A", SYSTEM_A), ("B", SYSTEM_B)):
            d = table.choose(key_of(chat(system, f"question {turn}")), ["r0", "r1"], f"{agent}{turn}")
            table.finished(f"{agent}{turn}")
            placed[agent].add(d.replica)
            assert d.reason == ("no_match" if turn == 0 else "prefix"), (agent, turn, d)
            if turn:
                assert d.match_chars > len(system)
    assert len(placed["A"]) == len(placed["B"]) == 1
    assert placed["A"] != placed["B"]  # the second agent's first request went to the empty replica


def test_round_robin_and_least_loaded_ignore_prefixes():
    rr = RoutingTable(RoutingConfig(policy="round_robin"))
    got = [rr.choose(key_of(chat(SYSTEM_A, "q")), ["r0", "r1", "r2"]).replica for _ in range(6)]
    assert got == ["r0", "r1", "r2", "r0", "r1", "r2"]
    ll = RoutingTable(RoutingConfig(policy="least_loaded"))
    assert ll.choose(key_of(chat(SYSTEM_A, "q")), ["r0", "r1"], "a").replica == "r0"
    assert ll.choose(key_of(chat(SYSTEM_A, "q")), ["r0", "r1"], "b").replica == "r1"
    ll.finished("a")
    assert ll.choose(key_of(chat(SYSTEM_A, "q")), ["r0", "r1"], "c").replica == "r0"
    assert ll.in_flight("r0") == 1 and ll.in_flight("r1") == 1


def test_load_beyond_the_threshold_sends_a_match_to_the_least_loaded():
    table = RoutingTable(RoutingConfig(policy="prefix", load_threshold=2))
    table.update_replicas({"r0": None, "r1": None})
    first = table.choose(key_of(chat(SYSTEM_A, "q")), ["r0", "r1"], "req0")
    home, other = first.replica, ("r1" if first.replica == "r0" else "r0")
    # in flight: home 1, other 0 -> 1 and 2 more are within the threshold of 2 ...
    for i in (1, 2):
        d = table.choose(key_of(chat(SYSTEM_A, f"q{i}")), ["r0", "r1"], f"req{i}")
        assert (d.replica, d.reason) == (home, "prefix")
    # ... home now has 3 in flight, 3 more than `other`: over the threshold
    d = table.choose(key_of(chat(SYSTEM_A, "q3")), ["r0", "r1"], "req3")
    assert (d.replica, d.reason) == (other, "load")
    for i in range(4):
        table.finished(f"req{i}")
    assert table.in_flight(home) == table.in_flight(other) == 0
    d = table.choose(key_of(chat(SYSTEM_A, "q4")), ["r0", "r1"], "req4")
    # both hold the prefix now, at equal load: the tie goes to the replica with the smaller tree
    assert (d.replica, d.reason) == (other, "prefix")


def test_a_short_match_is_no_match():
    table = RoutingTable(RoutingConfig(policy="prefix", min_match_ratio=0.5, chunk_chars=16))
    table.update_replicas({"r0": None, "r1": None})
    table.choose(key_of(chat("shared preamble " * 4, "x"), 16), ["r0", "r1"], "a")
    table.finished("a")
    # the same preamble followed by a much longer text of its own: under half of it matches
    d = table.choose(key_of(chat("shared preamble " * 4 + "z" * 2000, "x"), 16), ["r0", "r1"], "b")
    assert d.reason == "no_match"


def test_requests_without_a_key_and_targeted_requests():
    table = RoutingTable(RoutingConfig())
    d = table.choose(None, ["r0", "r1"], "a")
    assert d.reason == "no_key"
    assert table.choose(RouteKey(target="r1"), ["r0", "r1"]).replica == "r1"
    # a target that is gone is routed like a request without a key
    assert table.choose(RouteKey(target="r9"), ["r0", "r1"]).reason == "no_key"
    with pytest.raises(ValueError, match="no replica"):
        table.choose(None, [])


def test_a_request_routed_again_moves_its_load():
    table = RoutingTable(RoutingConfig(policy="least_loaded"))
    table.choose(None, ["r0", "r1"], "a")
    table.choose(None, ["r1"], "a")  # Serve asked again (r0 refused it)
    assert (table.in_flight("r0"), table.in_flight("r1")) == (0, 1)
    table.finished("a")
    table.finished("a")  # completion reported twice: never below zero
    assert table.in_flight("r1") == 0


def test_a_replica_that_goes_away_takes_its_tree_and_load_along():
    table = RoutingTable(RoutingConfig())
    table.update_replicas({"r0": None, "r1": None})
    d = table.choose(key_of(chat(SYSTEM_A, "q")), ["r0", "r1"], "a")
    table.remove_replica(d.replica)
    assert table.replica_ids() == sorted({"r0", "r1"} - {d.replica})
    table.update_replicas({"r0": None, "r2": None})  # restarted under a new id
    assert table.replica_ids() == ["r0", "r2"]
    assert table.tree("r2").num_chunks == 0


def test_the_replicas_kv_capacity_bounds_its_tree():
    table = RoutingTable(RoutingConfig(chunk_chars=64, chars_per_token=4.0, max_tree_chars=1 << 20))
    table.update_replicas({"r0": 1024, "r1": None})
    assert table.tree("r0").max_chunks == 1024 * 4 // 64
    assert table.tree("r1").max_chunks == (1 << 20) // 64


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("policy", "random", "routing policy must be one of"),
        ("chunk_chars", 0, "chunk_chars must be >= 1"),
        ("max_tree_chars", 10, "max_tree_chars must be >= chunk_chars"),
        ("load_threshold", -1, "load_threshold must be >= 0"),
        ("min_match_ratio", 1.5, "min_match_ratio must be in"),
        ("chars_per_token", 0, "chars_per_token must be > 0"),
    ],
)
def test_bad_routing_settings_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**{field: value})


def metric_values(text: str | bytes) -> dict:
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_routing_counters_on_metrics():
    table = RoutingTable(RoutingConfig(policy="prefix"))
    table.update_replicas({"r0": None, "r1": None})
    for i in range(3):
        table.choose(key_of(chat(SYSTEM_A, f"q{i}")), ["r0", "r1"], f"a{i}")
    values = metric_values(table.metrics_text())
    assert values[("agentrt_routing_decisions_total", (("policy", "prefix"), ("reason", "no_match")))] == 1
    assert values[("agentrt_routing_decisions_total", (("policy", "prefix"), ("reason", "prefix")))] == 2
    assert values[("agentrt_routing_prefix_match_chars_count", ())] == 3
    assert values[("agentrt_routing_prefix_match_chars_bucket", (("le", "0.0"),))] == 1
    assert values[("agentrt_routing_replicas", ())] == 2
    in_flight = {k[1][0][1]: v for k, v in values.items() if k[0] == "agentrt_routing_in_flight"}
    assert sorted(in_flight.values()) == [0, 3]


def test_replica_metrics_are_merged_under_a_replica_label():
    text = (
        "# HELP agentrt_generation_tokens_total Tokens generated\n# TYPE agentrt_generation_tokens_total counter\n"
        "agentrt_generation_tokens_total 5.0\n"
        '# HELP x_seconds Latency\n# TYPE x_seconds histogram\nx_seconds_bucket{le="1.0"} 1.0\n'
        'x_seconds_bucket{le="+Inf"} 2.0\nx_seconds_count 2.0\nx_seconds_sum 3.0\n'
    )
    values = metric_values(merge_replica_metrics({"r0": text, "r1": text.replace("5.0", "7.0"), "r2": None}))
    assert values[("agentrt_generation_tokens_total", (("replica", "r0"),))] == 5
    assert values[("agentrt_generation_tokens_total", (("replica", "r1"),))] == 7
    assert values[("x_seconds_bucket", (("le", "+Inf"), ("replica", "r1")))] == 2
    assert values[("agentrt_replica_up", (("replica", "r2"),))] == 0
    assert values[("agentrt_replica_up", (("replica", "r0"),))] == 1
