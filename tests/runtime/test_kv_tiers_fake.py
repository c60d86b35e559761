"""KV tiers under the radix tree (runtime/kv_tiers.py, prefix_cache/tier_store.py) on the fake model
runner: its KV pool holds each token's (id, position, prefix hash) and checks them on every read, so
a block loaded back into the wrong slots, from the wrong prefix or another namespace fails the run,
and every output is compared with the fake's own greedy reference."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys

import pytest

from agentrt.prefix_cache import tier_store
from agentrt.prefix_cache.block_keys import block_key, chain_keys, tail_key
from agentrt.prefix_cache.tier_store import Block, BlockCodec, DiskTier, HostTier
from agentrt.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from agentrt.runtime.request import SamplingParams
from agentrt.testing import fake_engine

pytestmark = pytest.mark.usefixtures("time_limit")

BLOCK = 8


def _params(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _config(**cache) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
        cache=CacheConfig(kv_tier_block_tokens=BLOCK, **cache),
    )


def _agents(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(n)]


def _run_trace(engine, agents: list[list[int]], turns: int, salt: str = ""):
    """Each agent in turn sends its history (prompt + earlier outputs + a new message); returns
    the outputs and each request's prompt."""
    history = [list(a) for a in agents]
    outs, prompts = [], []
    rng = random.Random(1)
    for _ in range(turns):
        for i in range(len(agents)):
            prompt = history[i] + [rng.randrange(32, 127) for _ in range(5)]
            req = engine.add_request(prompt, _params(), cache_salt=salt)
            while engine.has_work():
                for out in engine.step():
                    if out.finished and out.request_id == req.request_id:
                        outs.append(out)
            prompts.append(prompt)
            history[i] = prompt + outs[-1].token_ids
    return outs, prompts


def _check(engine, outs, prompts):
    ref = engine.runner
    assert [o.token_ids for o in outs] == [ref.greedy_continuation(p, 6) for p in prompts]


# ---- the stores -------------------------------------------------------------------------------
def test_chain_keys_name_the_whole_prefix_and_its_namespace():
    a = list(range(40))
    assert chain_keys(a, "", 8) == chain_keys(a + [99, 98], "", 8)  # a partial block has no key
    assert len(chain_keys(a, "", 8)) == 5
    b = [7] + a[1:]
    assert all(
        x != y for x, y in zip(chain_keys(a, "", 8), chain_keys(b, "", 8))
    )  # every key depends on token 0
    assert set(chain_keys(a, "t1", 8)).isdisjoint(chain_keys(a, "", 8))
    with pytest.raises(ValueError, match="block_tokens"):
        chain_keys(a, "", 0)
    # a trailing partial block's key: its own hash domain, under the block before it
    parent = chain_keys(a, "", 8)[-1]
    assert tail_key(parent, [1, 2]) != block_key(parent, [1, 2])
    assert tail_key(parent, [1, 2]) != tail_key(chain_keys(b, "", 8)[-1], [1, 2])


def test_codec_is_lossless():
    raw = bytes(random.Random(0).randrange(256) for _ in range(4096)) + bytes(4096)
    for name in ("zstd", "none"):
        codec = BlockCodec(name, typesize=4)
        assert codec.decode(codec.encode(raw)) == raw
    assert len(BlockCodec("zstd").encode(bytes(65536))) < 2000
    with pytest.raises(ValueError, match="zstd or none"):
        BlockCodec("lz77")


def test_host_tier_is_an_lru_under_its_byte_limit():
    blocks = [Block(bytes([i]) * 16, (i,), bytes(1000)) for i in range(5)]
    host = HostTier(3 * blocks[0].nbytes)
    assert host.put(blocks[0]) == [] and host.put(blocks[1]) == [] and host.put(blocks[2]) == []
    assert host.get(blocks[0].key) is blocks[0]  # 0 is now the most recent
    assert host.put(blocks[3]) == [blocks[1]]
    assert host.keys_lru() == [blocks[2].key, blocks[0].key, blocks[3].key]
    assert host.nbytes == 3 * blocks[0].nbytes
    assert host.put(Block(b"x" * 16, (), bytes(10_000))) != []  # larger than the tier: not kept
    assert len(host) == 3


def test_disk_tier_survives_a_reopen_and_skips_a_corrupt_file(tmp_path):
    fp = b"f" * 16
    disk = DiskTier(tmp_path, 1 << 20, fp, "test")
    blocks = [Block(bytes([i]) * 16, (i, i + 1), bytes([i]) * 500) for i in range(3)]
    for b in blocks:
        assert disk.put(b)
    again = DiskTier(tmp_path, 1 << 20, fp, "test")
    assert len(again) == 3 and again.get(blocks[1].key) == blocks[1]
    path = tmp_path / f"{blocks[2].key.hex()}.kvb"
    path.write_bytes(path.read_bytes()[:-7])  # torn
    (tmp_path / f"{blocks[0].key.hex()}.kvb").write_bytes(b"AKVB" + bytes(200))  # garbage
    assert again.get(blocks[2].key) is None and again.get(blocks[0].key) is None
    assert not path.exists() and len(again) == 1 and again.num_discarded == 2
    (tmp_path / "half.kvb.123.tmp").write_bytes(b"partial")  # a write cut short by a crash...
    os.utime(tmp_path / "half.kvb.123.tmp", (1, 1))  # ...long ago
    DiskTier(tmp_path, 1 << 20, fp, "test")
    assert not (tmp_path / "half.kvb.123.tmp").exists()


def test_a_disk_tier_opening_leaves_another_stores_write_under_way(tmp_path):
    """Two stores on one directory (replicas sharing a disk tier, or an engine started while another
    runs): the second one's start deletes only temporary files whose writer is gone, so a write
    under way in the first still lands (CI once saw it fail its rename and turn the tier off)."""
    fp = b"f" * 16
    first = DiskTier(tmp_path, 1 << 20, fp, "test")
    block = Block(b"a" * 16, (1, 2), b"x" * 300)
    path = tmp_path / f"{block.key.hex()}.kvb"
    real_replace = os.replace

    def replace_after_another_store_opens(src, dst):  # the second store starts mid-write
        DiskTier(tmp_path, 1 << 20, fp, "test")
        real_replace(src, dst)

    os.replace = replace_after_another_store_opens
    try:
        assert first.put(block)
    finally:
        os.replace = real_replace
    assert first.enabled and path.exists() and first.get(block.key) == block
    # a fresh temporary file of a process that has exited is a crash's: deleted at the next start
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True
    )
    host = tier_store._HOST
    dead = tmp_path / f"{block.key.hex()}.kvb.{host}-{int(proc.stdout)}-1.tmp"
    live = tmp_path / f"{block.key.hex()}.kvb.{host}-{os.getpid()}-1.tmp"
    elsewhere = tmp_path / f"{block.key.hex()}.kvb.00000000-{int(proc.stdout)}-1.tmp"
    for f in (dead, live, elsewhere):
        f.write_bytes(b"partial")
    odd = tmp_path / f"{block.key.hex()}.kvb.{host}-\u00b2-1.tmp"  # a digit int() does not take
    odd.write_bytes(b"junk")
    DiskTier(tmp_path, 1 << 20, fp, "test")
    assert not dead.exists() and live.exists() and elsewhere.exists() and odd.exists()


def test_a_disk_tier_opens_while_another_store_deletes_its_files(tmp_path, monkeypatch):
    """A block file another store deletes between this store's listing and its stat is skipped (it
    turned the opening store's tier off)."""
    fp = b"f" * 16
    first = DiskTier(tmp_path, 1 << 20, fp, "test")
    blocks = [Block(bytes([i]) * 16, (i,), bytes(100)) for i in range(3)]
    for b in blocks:
        assert first.put(b)
    gone = tmp_path / f"{blocks[1].key.hex()}.kvb"
    real_glob = type(tmp_path).glob

    def glob_then_delete(self, pattern):
        found = list(real_glob(self, pattern))
        if pattern == "*.kvb":
            gone.unlink()  # the other store's trim, right after the listing
        return iter(found)

    monkeypatch.setattr(type(tmp_path), "glob", glob_then_delete)
    second = DiskTier(tmp_path, 1 << 20, fp, "test")
    assert second.enabled and len(second) == 2 and second.get(blocks[0].key) == blocks[0]


def test_disk_tier_discards_another_fingerprints_files(tmp_path, caplog):
    disk = DiskTier(tmp_path, 1 << 20, b"a" * 16, "model A")
    disk.put(Block(b"k" * 16, (1,), b"payload"))
    other = DiskTier(tmp_path, 1 << 20, b"b" * 16, "model B")
    assert len(other) == 0 and other.num_discarded == 1
    assert "another model" in caplog.text
    assert list(tmp_path.glob("*.kvb")) == []


def test_disk_tier_keeps_its_byte_limit_lru_first(tmp_path):
    blocks = [Block(bytes([i]) * 16, (i,), bytes(1000)) for i in range(4)]
    disk = DiskTier(tmp_path, 2500, b"f" * 16)
    for b in blocks[:2]:
        disk.put(b)
    disk.get(blocks[0].key)
    disk.put(blocks[2])
    assert blocks[1].key not in disk and blocks[0].key in disk and blocks[2].key in disk
    assert disk.nbytes <= 2500 and len(list(tmp_path.glob("*.kvb"))) == 2


def test_an_unusable_disk_turns_the_tier_off_without_failing(tmp_path, caplog, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    disk = DiskTier(not_a_dir / "kv", 1 << 20, b"f" * 16)
    assert not disk.enabled and "KV disk tier off" in caplog.text
    assert not disk.put(Block(b"k" * 16, (1,), b"p")) and disk.get(b"k" * 16) is None
    full = DiskTier(tmp_path / "full", 1 << 20, b"f" * 16)

    def enospc(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(full, "_write_atomic", enospc)
    assert not full.put(Block(b"k" * 16, (1,), b"p")) and not full.enabled


# ---- the engine -------------------------------------------------------------------------------
def test_evicted_prefixes_come_back_from_the_host_tier_with_the_same_outputs():
    agents = _agents(6, 60)
    # the pool holds ~2 agents' histories; the trace's working set is ~4x that
    plain = fake_engine(_config(), num_kv_slots=200)
    outs0, prompts0 = _run_trace(plain, agents, 3)
    tiered = fake_engine(_config(kv_host_bytes=64 << 20), num_kv_slots=200)
    outs1, prompts1 = _run_trace(tiered, agents, 3)
    assert prompts1 == prompts0
    _check(tiered, outs1, prompts1)
    host = sum(o.cached_tokens_by_tier.get("host", 0) for o in outs1)
    assert host > 0
    assert sum(o.num_cached_tokens for o in outs1) > sum(o.num_cached_tokens for o in outs0) + host // 2
    # with an unbounded pool every history after the first turn is a hit up to its last block
    big = fake_engine(_config(), num_kv_slots=20_000)
    outs2, _ = _run_trace(big, agents, 3)
    share = [
        sum(o.num_cached_tokens for o in outs) / sum(len(p) for p in prompts0) for outs in (outs1, outs2)
    ]
    assert share[0] > share[1] - 0.1, share
    m = tiered.metrics.registry.get_sample_value
    assert m("agentrt_kv_tier_hit_tokens_total", {"tier": "host"}) == host
    assert m("agentrt_kv_tier_blocks", {"tier": "host"}) > 0
    assert m("agentrt_kv_tier_loads_total") > 0
    tiered.close()


def test_a_restarted_engine_finds_prefixes_on_disk(tmp_path):
    agents = _agents(3, 50, seed=2)
    first = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
    outs, prompts = _run_trace(first, agents, 1)
    first.close()  # (a SIGKILLed server: tests/api/test_kv_tiers_server.py)
    assert len(list(tmp_path.glob("*.kvb"))) >= 3 * (50 // BLOCK)
    second = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
    again = [second.generate([(p, _params(), None)])[0] for p in prompts]
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    for o, p in zip(again, prompts):
        assert (
            o.cached_tokens_by_tier.get("disk", 0) == o.num_cached_tokens == len(p) - 1
        )  # up to the last prompt token (a tail block)
    second.close()


def test_a_different_block_size_discards_the_disk_tier(tmp_path):
    agents = _agents(1, 40, seed=3)
    e = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
    _run_trace(e, agents, 1)
    e.close()
    other = fake_engine(
        EngineConfig(cache=CacheConfig(kv_disk_dir=str(tmp_path), kv_tier_block_tokens=16)), num_kv_slots=400
    )
    out = other.generate([(agents[0] + [40, 41], _params(), None)])[0]
    assert out.num_cached_tokens == 0 and other.tiers.disk.num_discarded > 0
    other.close()


def test_cache_salt_isolation_holds_in_the_lower_tiers(tmp_path):
    agents = _agents(4, 60, seed=4)
    e = fake_engine(_config(kv_host_bytes=64 << 20, kv_disk_dir=str(tmp_path)), num_kv_slots=150)
    _run_trace(e, agents, 2, salt="tenant-a")
    e.tiers.flush()
    outs, prompts = _run_trace(e, agents[:1], 1, salt="tenant-b")
    assert outs[0].num_cached_tokens == 0 and outs[0].cached_tokens_by_tier == {}
    _check(e, outs, prompts)
    e.close()


def test_tiers_need_the_prefix_cache_and_valid_limits():
    with pytest.raises(ValueError, match="need the prefix cache"):
        CacheConfig(kv_host_bytes=1 << 20, enable_prefix_cache=False)
    with pytest.raises(ValueError, match="kv_host_bytes"):
        CacheConfig(kv_host_bytes=-1)
    with pytest.raises(ValueError, match="kv_tier_compress"):
        CacheConfig(kv_tier_compress="gzip")


def test_a_request_aborted_while_its_blocks_load_leaks_nothing():
    agents = _agents(5, 60, seed=5)
    e = fake_engine(_config(kv_host_bytes=64 << 20), num_kv_slots=150)
    _, prompts = _run_trace(e, agents, 1)
    e.tiers.flush()
    req = e.add_request(prompts[0] + [33], _params())  # agent 0's prefix was evicted to the host tier
    e.step()
    assert req.cache.tier_load is not None  # waiting for its blocks
    assert e.abort(req.request_id).finish_reason == "abort"
    assert req.cache.tier_load is None and req.cache.tier_node is None
    while e.has_work():
        e.step()
    e.tiers.flush()
    e.step()  # nothing to promote: the load's result is dropped
    kv, cache = e.runner.kv, e.scheduler.cache
    assert cache.locked_tokens == 0 and kv.num_free + cache.total_tokens == kv.num_slots
    again = e.generate([(prompts[0] + [33], _params(), None)])[0]
    assert again.token_ids == e.runner.greedy_continuation(prompts[0] + [33], 6)
    assert again.cached_tokens_by_tier.get("host", 0) > 0
    e.close()


def test_a_returning_agent_resumes_at_its_last_token_after_a_restart(tmp_path):
    """A finished request's trailing partial block is written through too (block_keys.tail_key), at
    the end of its tokens and one token before the end of its prompt: after a restart the agent's
    next turn (its prompt + the output + a new message) is cached up to the request's last computed
    token, and the same prompt again (alone or followed by other text) up to its last token, as a hit
    in the pool would be."""
    agents = _agents(3, 45, seed=5)  # 45 + 5 = 50 prompt tokens: ends mid-block (BLOCK 8)
    first = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
    outs, prompts = _run_trace(first, agents, 1)
    first.close()
    second = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
    for out, p in zip(outs, prompts):
        computed = len(p) + len(out.token_ids) - 1  # the last output token has no KV yet
        assert computed % BLOCK  # the test needs a partial last block
        nxt = p + out.token_ids + [40, 41, 42]
        res = second.generate([(nxt, _params(), None)])[0]
        assert res.num_cached_tokens == res.cached_tokens_by_tier["disk"] == computed
        assert res.token_ids == second.runner.greedy_continuation(nxt, 6)
        # on fresh engines (their pools hold nothing): the same prompt again, and the prompt again
        # followed by other text, each from disk up to the prompt's last token
        for retry in (p, p + [33, 34, 35]):
            fresh = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
            res = fresh.generate([(retry, _params(), None)])[0]
            assert res.num_cached_tokens == res.cached_tokens_by_tier["disk"] == len(p) - 1
            assert res.token_ids == fresh.runner.greedy_continuation(retry, 6)
            fresh.close()
    second.close()


def test_a_block_read_from_disk_stays_in_the_host_tier(tmp_path):
    """With both tiers, a block loaded from disk is kept in the host tier as well: the prefix's next
    return, after the pool evicted it again, is served from memory."""
    agents = _agents(4, 60, seed=7)
    first = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
    _, prompts = _run_trace(first, agents, 1)
    first.close()
    second = fake_engine(_config(kv_host_bytes=64 << 20, kv_disk_dir=str(tmp_path)), num_kv_slots=150)
    a = second.generate([(prompts[0], _params(), None)])[0]
    assert a.cached_tokens_by_tier.get("disk", 0) > 0 and "host" not in a.cached_tokens_by_tier
    for p in prompts[1:]:  # the pool (150 slots) evicts prompts[0]'s blocks
        second.generate([(p, _params(), None)])
    b = second.generate([(prompts[0], _params(), None)])[0]
    assert b.cached_tokens_by_tier.get("host", 0) > 0 and "disk" not in b.cached_tokens_by_tier
    assert b.token_ids == a.token_ids == second.runner.greedy_continuation(prompts[0], 6)
    second.close()


def test_corrupt_disk_files_are_all_dropped_and_rewritten_by_the_first_request(tmp_path):
    """Every other block file of a prompt corrupted while the server was down: the first request
    after the restart skips them (same output), checks the rest of its run at once and writes the
    bad blocks again, so a second restart serves the whole prompt from disk (not one block more per
    request). A lone-surrogate cache_salt (JSON allows "\\ud800") has keys too, never an error."""
    prompt = _agents(1, 90, seed=9)[0]
    first = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
    ref = first.generate([(prompt, _params(), None)])[0]
    first.close()
    files = sorted(tmp_path.glob("*.kvb"))
    for f in files[::2]:
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    for _ in range(2):
        e = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
        out = e.generate([(prompt, _params(), None)])[0]
        assert out.token_ids == ref.token_ids
        e.close()
    assert out.cached_tokens_by_tier["disk"] == len(prompt) - 1
    e = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
    salted = e.add_request(prompt, _params(), cache_salt="\ud800")
    while e.has_work():
        e.step()
    assert salted.cache.num_cached_tokens == 0
    e.close()


def test_odd_entries_in_the_disk_directory_do_not_turn_the_tier_off(tmp_path):
    """A dangling `<key>.kvb` symlink, a directory named like a block file and one named `*.tmp` are
    not block files: the tier opens, skips them and keeps serving from the real blocks."""
    prompt = _agents(1, 60, seed=11)[0]
    first = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
    ref = first.generate([(prompt, _params(), None)])[0]
    first.close()
    (tmp_path / ("ab" * 16 + ".kvb")).symlink_to(tmp_path / "nowhere")
    (tmp_path / ("cd" * 16 + ".kvb")).mkdir()
    (tmp_path / "junk.tmp").mkdir()
    second = fake_engine(_config(kv_disk_dir=str(tmp_path)), num_kv_slots=400)
    assert second.tiers.disk.enabled
    out = second.generate([(prompt, _params(), None)])[0]
    assert out.token_ids == ref.token_ids and out.cached_tokens_by_tier["disk"] == len(prompt) - 1
    assert second.tiers.disk.enabled
    second.close()


def test_byte_size_flags_take_units_and_name_bad_values():
    """--kv-cache-bytes / --kv-host-bytes / --kv-disk-bytes: an integer or a binary unit (4G = 4 GiB);
    garbage, negative, infinite and fractional byte counts are refused naming the value."""
    import argparse

    from agentrt.engine_args import add_engine_args, byte_size

    assert byte_size("4G") == 4 << 30 and byte_size("512MiB") == 512 << 20 and byte_size("1536") == 1536
    assert byte_size("1.5K") == 1536
    for bad in ("abc", "-1", "inf", "nan", "0.5", "1.5Q", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="byte"):
            byte_size(bad)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--kv-cache-bytes", "1G", "--kv-host-bytes", "2G", "--kv-disk-bytes", "3G"])
    assert (args.kv_cache_bytes, args.kv_host_bytes, args.kv_disk_bytes) == (1 << 30, 2 << 30, 3 << 30)
