"""Radix tree: match/insert/split/lock/evict, and a property test against a dict-of-prefixes model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentrt.prefix_cache import RadixCache


def test_match_insert_split():
    t = RadixCache()
    assert t.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    assert t.match_prefix([1, 2, 3, 4, 5]).slots == [10, 11, 12, 13]
    assert t.match_prefix([1, 2, 9]).slots == [10, 11]
    # a diverging insert splits the edge after [1, 2]
    assert t.insert([1, 2, 7, 8], [20, 21, 22, 23]) == 2
    assert t.match_prefix([1, 2, 7, 8]).slots == [10, 11, 22, 23]
    assert t.match_prefix([1, 2, 3]).slots == [10, 11, 12]
    assert t.total_tokens == 6
    assert t.match_prefix([5]).slots == []


def test_match_does_not_modify():
    t = RadixCache()
    t.insert([1, 2, 3], [1, 2, 3])
    before = (t.total_tokens, t.root().children[1].key, t.root().children[1].last_access)
    t.match_prefix([1, 2, 9])
    assert (t.total_tokens, t.root().children[1].key, t.root().children[1].last_access) == before


def test_evict_lru_leaves_first_and_parents_become_leaves():
    t = RadixCache()
    t.insert([1, 2, 3], [1, 2, 3])
    t.insert([1, 2, 4], [4, 5, 6])  # split: [1,2] -> {[3], [4]}; slots 4,5 are the caller's duplicates
    t.insert([9, 9], [7, 8])
    t.touch(t.match_prefix([1, 2, 3]).node)  # [1,2,3] most recent
    assert t.evict(1) == [6]  # leaf [4] is older than [9,9] (inserted before it)
    assert t.evict(2) == [7, 8]
    assert sorted(t.evict(10)) == [1, 2, 3]  # [3] then its parent [1,2] became a leaf
    assert t.total_tokens == 0


def test_evict_never_frees_locked():
    t = RadixCache()
    t.insert([1, 2, 3], [1, 2, 3])
    t.insert([1, 2, 4], [4, 5, 6])
    m = t.match_prefix([1, 2, 3])
    t.lock(m.node)
    assert t.evict(100) == [6]  # only the unlocked sibling
    assert t.match_prefix([1, 2, 3]).slots == [1, 2, 3]
    assert t.evictable_tokens == 0
    t.unlock(m.node)
    assert sorted(t.evict(100)) == [1, 2, 3]


def test_evicted_snapshots_are_shown_to_the_hook_with_their_prefix():
    """A hybrid model's snapshots go down to the KV tiers: `evict` shows each leaf's snapshot, and
    `evict_states` each snapshot it drops alone (start = the prefix's length: its KV stays)."""
    t = RadixCache()
    freed = []
    t.free_state = freed.append
    t.insert([1, 2, 3, 4], [10, 11, 12, 13], "s")
    assert t.set_state([1, 2], 7, "s") and t.set_state([1, 2, 3, 4], 8, "s")
    assert t.path_states([1, 2, 3, 4, 5], "s") == [(2, 7), (4, 8)]
    assert t.path_states([1, 2, 3], "s") == [(2, 7)] and t.path_states([1, 2]) == []
    seen = []
    t.match_prefix([1, 2, 3, 4], "s").node.last_access += 1  # the deeper snapshot used last
    assert t.evict_states(1, lambda *a: seen.append(a)) == 1
    assert seen == [([1, 2], [10, 11], 2, "s", 7)] and freed == [7]
    assert t.evict(2, lambda *a: seen.append(a)) == [12, 13]
    assert seen[1] == ([1, 2, 3, 4], [10, 11, 12, 13], 2, "s", 8) and freed == [7, 8]
    assert t.num_states == 0 and t.total_tokens == 2


def test_lock_survives_split():
    t = RadixCache()
    t.insert([1, 2, 3, 4], [1, 2, 3, 4])
    node = t.match_prefix([1, 2, 3, 4]).node
    t.lock(node)
    t.insert([1, 2, 9], [0, 0, 9])  # splits the locked edge
    assert t.evict(100) == [9]
    assert t.locked_tokens == 4
    t.unlock(node)
    assert t.locked_tokens == 0 and t.evictable_tokens == 4


def test_salts_are_separate():
    t = RadixCache()
    t.insert([1, 2], [1, 2], salt="a")
    assert t.match_prefix([1, 2], salt="b").slots == []
    assert t.match_prefix([1, 2], salt="a").slots == [1, 2]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=8)),
        st.tuples(st.just("evict"), st.integers(1, 6)),
        st.tuples(st.just("lock"), st.lists(st.integers(0, 3), min_size=1, max_size=8)),
        st.tuples(st.just("unlock"), st.integers(0, 5)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_property_against_model(ops):
    """Model: a set of cached prefixes with the slot of each cached token position. Invariants:
    every match returns the slots inserted for that exact prefix; evicted slots are never matched
    again; locked prefixes stay matched; token counts add up."""
    t = RadixCache()
    slot_of: dict[tuple[int, ...], int] = {}  # cached prefix -> slot of its last token
    next_slot = 0
    locks: list[tuple[tuple[int, ...], object]] = []
    for op, arg in ops:
        if op == "insert":
            slots = list(range(next_slot, next_slot + len(arg)))
            next_slot += len(arg)
            present = t.insert(arg, slots)
            for k in range(len(arg)):
                prefix = tuple(arg[: k + 1])
                if k < present:
                    assert prefix in slot_of
                else:
                    assert prefix not in slot_of
                    slot_of[prefix] = slots[k]
        elif op == "evict":
            freed = set(t.evict(arg))
            removed = {p for p, s in slot_of.items() if s in freed}
            assert len(removed) == len(freed)
            for p in removed:
                del slot_of[p]
            # an evicted prefix never has a cached extension left behind
            for p in slot_of:
                assert all(p[:k] in slot_of for k in range(1, len(p)))
        elif op == "lock":
            m = t.match_prefix(arg)
            t.lock(m.node)
            locks.append((tuple(arg[: len(m.slots)]), m.node))
        elif op == "unlock" and locks:
            _, node = locks.pop(arg % len(locks))
            t.unlock(node)
        for prefix, _ in locks:
            assert all(prefix[: k + 1] in slot_of for k in range(len(prefix)))
        assert t.total_tokens == len(slot_of)
        for p, s in slot_of.items():
            assert t.match_prefix(list(p)).slots[-1] == s
