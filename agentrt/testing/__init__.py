"""Public testing utilities: a fake model runner (no weights), one launcher for `agentrt serve`, and
fault injection.

    fake_runner.py  FakeModelRunner, byte_tokenizer, fake_engine
    server.py       launch_server / agentrt_server / serve_in_thread / free_port
    faults.py       FaultInjector (one request's matcher, forward, sampler input, ... raises)


`FakeModelRunner` stands in for `agentrt.runtime.model_runner.ModelRunner` behind a real `Engine`
(`Engine(config, runner=FakeModelRunner())`): the scheduler, the real `KVPool`, the prefix cache,
grammar masking, sampling, stop handling and speculation run their own code, and a step takes
milliseconds. Its logits are a fixed function of the token sequence, so greedy output is a fixed
function of the prompt whatever the batch, the chunking, preemption or the prefix cache did: the
engine's invariants become exact equalities a test can check.

The fake also checks the engine's KV bookkeeping. Each KV slot holds what the fake wrote there
(token id, position, a hash of the whole prefix up to that token); every forward reads back the
context of each sequence from the slots the engine hands it and raises `KVCorruptionError` when a
slot is free, out of range, repeated, or holds another sequence's token (wrong position or a broken
prefix-hash chain). A double free raises too. With `window=None` (default) the logits depend on the
whole prefix as read from the KV pool, so a prefix-cache hit mapped to the wrong slots changes the
output.

`agentrt_server` / `launch_server` start a server subprocess on a free port, wait for GET /health
and stop it on exit (tests and bench scripts share them). `serve_in_thread` serves an app (e.g.
`create_app` over an AsyncEngine on the fake runner) with uvicorn in this process, so a test talks
HTTP to it and still reads the engine behind it.
"""

from agentrt.testing.fake_runner import (
    EOS_TOKEN,
    FakeArch,
    FakeModelRunner,
    ForwardRecord,
    KVCorruptionError,
    byte_tokenizer,
    fake_engine,
)
from agentrt.testing.faults import FAULT_KINDS, FaultInjector, InjectedFault
from agentrt.testing.server import (
    ServerProcess,
    ServerStartError,
    agentrt_server,
    free_port,
    launch_server,
    serve_in_thread,
)

__all__ = [
    "EOS_TOKEN",
    "FAULT_KINDS",
    "FakeArch",
    "FakeModelRunner",
    "FaultInjector",
    "ForwardRecord",
    "InjectedFault",
    "KVCorruptionError",
    "ServerProcess",
    "ServerStartError",
    "agentrt_server",
    "byte_tokenizer",
    "fake_engine",
    "free_port",
    "launch_server",
    "serve_in_thread",
]
