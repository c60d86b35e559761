"""The disk KV tier across a restart: a real `agentrt serve` on the default model, killed with
SIGKILL, started again on the same --kv-disk-dir, serves a returning agent's prompt from disk with
the same greedy output; a corrupt block is skipped; files of another KV layout are discarded."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from agentrt.testing import ServerStartError, agentrt_server

MODEL = "smollm2-135m-instruct"
SYSTEM = (
    "You are the planning agent of a warehouse team. You receive stock reports, shipping notices and "
    "customer complaints, and you answer with one short action for the floor staff. Keep every answer "
    "under twenty words, name the aisle when you know it, and never invent order numbers. "
) * 3


def _ask(url: str, question: str) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 12,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _serve(disk, log, *extra):
    return agentrt_server(
        MODEL, "--kv-disk-dir", str(disk), "--kv-cache-bytes", str(64 << 20), *extra, log_path=log
    )


def _first_life(disk, tmp_path, question: str) -> tuple[dict, list]:
    """Serve one request on a fresh disk tier, wait for its write-through, SIGKILL the server."""
    with _serve(disk, tmp_path / "a.log") as srv:
        first = _ask(srv.url, question)
        deadline = time.monotonic() + 60
        while _metric(srv.url, 'agentrt_kv_tier_stored_blocks_total{tier="disk"}') < 5:
            assert time.monotonic() < deadline, "nothing written through to disk"
            time.sleep(0.2)
        time.sleep(0.5)  # the store thread finishes the request's blocks
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
    files = sorted(disk.glob("*.kvb"))
    assert len(files) >= 5
    return first, files


@pytest.mark.slow  # two real servers, ~27 s on 2 cores; the disk tier's restart is covered in test_kv_tiers_fake
def test_a_killed_server_finds_its_agents_prefixes_on_disk(tmp_path, default_model_dir):
    disk, question = tmp_path / "kv", "Pallets of rice arrived damaged in aisle 4. What now?"
    try:
        first, _ = _first_life(disk, tmp_path, question)
        with _serve(disk, tmp_path / "b.log") as srv:
            again = _ask(srv.url, question)
    except ServerStartError as e:
        pytest.fail(str(e))
    details = again["usage"]["prompt_tokens_details"]
    assert (
        details["cached_tokens"] > 100
        and details["cached_tokens_by_tier"]["disk"] == details["cached_tokens"]
    )
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


@pytest.mark.slow  # three server starts (~1-2 min on 2 cores); the same checks run on the fake runner
def test_a_torn_block_is_skipped_and_another_layouts_files_discarded(tmp_path, default_model_dir):
    disk, question = tmp_path / "kv", "The cold room on aisle 9 reads 11 degrees. What now?"
    try:
        first, files = _first_life(disk, tmp_path, question)
        # the prompt's second block (files are written in block order, then the tail blocks)
        second = sorted(files, key=lambda p: p.stat().st_mtime_ns)[1]
        second.write_bytes(second.read_bytes()[:100])  # torn
        with _serve(disk, tmp_path / "c.log") as srv:
            again = _ask(srv.url, question)
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert 0 < again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert "failed its check" in (tmp_path / "c.log").read_text()
        with _serve(disk, tmp_path / "d.log", "--kv-tier-compress", "none") as srv:  # another KV layout
            other = _ask(srv.url, question)
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert "discarding them" in (tmp_path / "d.log").read_text()
    except ServerStartError as e:
        pytest.fail(str(e))
