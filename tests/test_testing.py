"""agentrt.testing: the fake model runner's logits and KV checks, and the server launcher."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from agentrt.runtime.forward import SeqChunk
from agentrt.testing import (
    FakeModelRunner,
    KVCorruptionError,
    ServerStartError,
    byte_tokenizer,
    free_port,
    launch_server,
)

pytestmark = pytest.mark.usefixtures("time_limit")


def test_byte_tokenizer_round_trips_bytes_and_has_an_eos():
    tok = byte_tokenizer()
    text = 'héllo {"a": 1}\n\t~'
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 256 and tok.convert_ids_to_tokens(256) == "<|endoftext|>"
    assert len(tok) == 260
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _prefill(runner, ids, chunk_sizes=None):
    """Prefill `ids` in chunks; returns (slots, logits of the last position [vocab])."""
    slots = runner.kv.allocate(len(ids))
    done, out = 0, None
    for n in chunk_sizes or [len(ids)]:
        last = done + n == len(ids)
        out = runner.execute([SeqChunk(ids[done : done + n], done, slots[: done + n], last)])
        done += n
    return slots, out[0]


def test_byte_tokenizer_keeps_no_memory_per_text():
    """No BPE word cache (it saves nothing without merges): a served fake runner tokenizing a
    unique chat message per request grew by ~1.7 KB per message, up to 10,000 of them."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc's mallinfo2")

    class MallInfo2(ctypes.Structure):
        _fields_ = [  # glibc's struct mallinfo2: ten size_t
            (n, ctypes.c_size_t)
            for n in [
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            ]
        ]

    libc.mallinfo2.restype = MallInfo2
    tok = byte_tokenizer()
    tok.encode("warm up", add_special_tokens=False)
    before = libc.mallinfo2().uordblks
    for i in range(4000):
        tok.encode(f"<|im_start|>user\nRequest {i * 7919} about a parcel to Hue.<|im_end|>\n")
    grown = libc.mallinfo2().uordblks - before
    assert grown < 1 << 20, f"{grown / 2**20:.1f} MiB kept after 4,000 distinct texts (a cache: ~6.6 MiB)"


def test_forward_records_can_be_turned_off_and_counts_stay():
    runs = []
    for record in (True, False):
        runner = FakeModelRunner(record_forwards=record)
        for text in (b"one", b"two three"):
            ids = list(text)
            runner.execute([SeqChunk(ids, 0, runner.kv.allocate(len(ids)), True)])
        runs.append((len(runner.forwards), runner.num_forwards, runner.num_computed_tokens))
    assert runs == [(2, 2, 12), (0, 2, 12)]


def test_logits_depend_on_the_sequence_only():
    runner = FakeModelRunner()
    ids = list(b"the same prompt, twice")
    _, whole = _prefill(runner, ids)
    _, chunked = _prefill(runner, ids, [5, 10, len(ids) - 15])
    assert torch.equal(whole, chunked) and whole.dtype == torch.float32 and whole.shape == (260,)
    assert int(whole.argmax()) == runner.greedy_next(ids)
    assert 0x20 <= runner.greedy_next(ids) < 0x7F  # printable ASCII is preferred
    _, other = _prefill(runner, list(b"another prompt, twice"))
    assert not torch.equal(whole, other)
    assert torch.equal(_prefill(FakeModelRunner(seed=0), ids)[1], whole)
    assert not torch.equal(_prefill(FakeModelRunner(seed=1), ids)[1], whole)


def test_window_makes_logits_depend_on_the_last_tokens_only():
    runner = FakeModelRunner(window=2)
    assert torch.equal(_prefill(runner, list(b"xxxab"))[1], _prefill(runner, list(b"yab"))[1])
    assert not torch.equal(_prefill(runner, list(b"xxxab"))[1], _prefill(runner, list(b"xxxaa"))[1])
    full = FakeModelRunner()
    assert not torch.equal(_prefill(full, list(b"xxxab"))[1], _prefill(full, list(b"yab"))[1])


def test_batch_rows_in_order_and_only_where_asked():
    runner = FakeModelRunner()
    a, b = list(b"first"), list(b"second one")
    sa, sb = runner.kv.allocate(len(a)), runner.kv.allocate(len(b))
    out = runner.execute(
        [
            SeqChunk(a, 0, sa, True),
            SeqChunk(b[:4], 0, sb[:4], False),
            SeqChunk(b[4:], 4, sb, True, num_logits=3),
        ]
    )
    assert out.shape == (4, 260)
    assert int(out[0].argmax()) == runner.greedy_next(a)
    assert [int(r.argmax()) for r in out[1:]] == [runner.greedy_next(b[:k]) for k in (8, 9, 10)]
    assert [f.chunks for f in runner.forwards] == [[(0, 5, 1), (0, 4, 0), (4, 6, 3)]]
    logits, hidden = runner.execute([], return_hidden=True)
    assert logits.shape == (0, 260) and hidden.shape == (0, 8)


def test_tree_chunk_positions_and_ancestors():
    runner = FakeModelRunner()
    root_slots, _ = _prefill(runner, list(b"ab"))
    # verify chunk: root "c" (the last token, at position 2) + node x (depth 1) and its children y, z
    new = runner.kv.allocate(4)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tokens = [ord("c"), ord("x"), ord("y"), ord("z")]
    out = runner.execute([SeqChunk(tokens, 2, root_slots + new, True, 4, [2, 3, 4, 4], mask)])
    assert [int(r.argmax()) for r in out] == [
        runner.greedy_next(list(b"abc" + s)) for s in (b"", b"x", b"xy", b"xz")
    ]
    with pytest.raises(KVCorruptionError, match="ancestors"):
        runner.execute([SeqChunk(tokens, 2, root_slots + new, True, 4, [2, 3, 4, 5], mask)])


def test_kv_misuse_is_caught():
    runner = FakeModelRunner(num_kv_slots=64)
    a_slots, _ = _prefill(runner, list(b"sequence a"))
    b_slots, _ = _prefill(runner, list(b"other text!"))
    nxt = runner.kv.allocate(1)
    ok = runner.execute([SeqChunk([1], 10, a_slots + nxt, True)])
    assert ok.shape == (1, 260)
    with pytest.raises(KVCorruptionError, match="another sequence"):  # b's slots in a's context
        runner.execute([SeqChunk([1], 10, a_slots[:5] + b_slots[5:10] + nxt, True)])
    # a shared prefix is not corruption: b's slots after a's identical first tokens read as b
    c_slots, _ = _prefill(runner, list(b"sequence b"))
    shared = runner.execute([SeqChunk([1], 10, a_slots[:9] + c_slots[9:] + nxt, True)])
    assert int(shared[0].argmax()) == runner.greedy_next(list(b"sequence b") + [1])
    with pytest.raises(KVCorruptionError, match="another sequence"):  # a's slots out of order
        runner.execute([SeqChunk([1], 10, a_slots[::-1] + nxt, True)])
    runner.kv.free(nxt)
    with pytest.raises(KVCorruptionError, match="free"):  # writing to a freed slot
        runner.execute([SeqChunk([1], 10, a_slots + nxt, True)])
    with pytest.raises(KVCorruptionError, match="double free"):
        runner.kv.free(nxt)
    with pytest.raises(KVCorruptionError, match="slots for"):
        runner.execute([SeqChunk([1, 2], 10, a_slots + nxt, True)])
    runner.kv.free(a_slots)
    with pytest.raises(KVCorruptionError, match="free"):  # reading a freed context
        runner.execute([SeqChunk([1], 10, a_slots + runner.kv.allocate(1), True)])
    assert runner.kv.num_free == 64 - len(b_slots) - len(c_slots) - 1


_HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        print("request", self.path, flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_launch_server_waits_for_health_and_stops_it(tmp_path):
    import httpx

    port = free_port()
    with launch_server(
        [sys.executable, "-c", _HEALTH_SERVER, str(port)], port, timeout_s=30, log_path=tmp_path / "log"
    ) as srv:
        assert srv.url == f"http://127.0.0.1:{port}"
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert srv.proc.poll() is None
    assert srv.proc.poll() is not None and srv.returncode == srv.proc.returncode
    assert "request /health" in srv.log_tail()


def test_launch_server_reports_a_process_that_exits(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
    with (
        pytest.raises(ServerStartError, match="exited with 3: boom"),
        launch_server(cmd, port, log_path=tmp_path / "log"),
    ):
        pass
