"""The ingress and replica halves without Ray: IngressCore (agentrt/scaleout/ingress.py) in front of
replicas in this process (AsgiForwarder over `create_app` on fake-runner engines, chosen by a
RoutingTable as Serve's router would), so forwarding, routing effects on the prefix cache, failure
shapes, /metrics and the perimeter are checked in seconds. The same code under Ray Serve:
tests/scaleout/test_serve_replicas.py. Also the CLI's scale-out flags and resource planning."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

import pytest
from fastapi.testclient import TestClient

from agentrt.api.app import create_app
from agentrt.api.middleware import ServerOptions
from agentrt.runtime.async_engine import AsyncEngine
from agentrt.scaleout.deploy import SERVE_INSTALL_HINT, plan_resources, replica_options, replica_spec
from agentrt.scaleout.ingress import REPLICA_HEADER, IngressCore
from agentrt.scaleout.policy import RoutingConfig, RoutingTable
from agentrt.scaleout.replica import AsgiForwarder, ForwardedRequest, ReplicaSpec, ResponseStart
from agentrt.testing import fake_engine

MODEL = "fake"
SYSTEM = {
    "A": "You are agent A. You answer questions about invoices, carefully. " * 12,
    "B": "You are agent B. You plan trips and book trains, always politely. " * 12,
}


class ReplicaDied(Exception):
    """Stands in for Ray's ActorDiedError."""


class LocalStream:
    """A ReplicaStream over an AsgiForwarder's answer; raises ReplicaDied after `fail_after` items
    (None: never); reports its end to the table as Serve's router does."""

    def __init__(self, gen, on_done, fail_after: int | None = None):
        self.gen, self.on_done, self.fail_after = gen, on_done, fail_after
        self.num_items = 0
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.fail_after is not None and self.num_items >= self.fail_after:
            await self.gen.aclose()
            self.on_done()
            raise ReplicaDied("the actor died unexpectedly")
        try:
            item = await self.gen.__anext__()
        except StopAsyncIteration:
            self.on_done()
            raise
        self.num_items += 1
        return item

    def cancel(self) -> None:
        self.cancelled = True
        asyncio.get_running_loop().create_task(self.gen.aclose())
        self.on_done()


class LocalReplicas:
    """`n` replicas (fake-runner engines + the real app) routed by a RoutingTable with `config`.
    `fail_after[replica]`: the items that replica answers before it 'dies' (0: before starting)."""

    def __init__(self, n: int, config: RoutingConfig):
        self.engines = [
            AsyncEngine(engine=fake_engine(max_model_len=8192, num_kv_slots=32768, record_forwards=False))
            for _ in range(n)
        ]
        self.forwarders = {
            f"r{i}": AsgiForwarder(create_app(e, MODEL, options=replica_options(ServerOptions())), f"r{i}")
            for i, e in enumerate(self.engines)
        }
        self.table = RoutingTable(config)
        self.table.update_replicas(dict.fromkeys(self.forwarders))
        self.fail_after: dict[str, int] = {}
        self.streams: list[LocalStream] = []

    def call(self, request: ForwardedRequest, key):
        request_id = uuid.uuid4().hex
        decision = self.table.choose(key, sorted(self.forwarders), request_id)
        stream = LocalStream(
            self.forwarders[decision.replica].forward(request),
            lambda: self.table.finished(request_id),
            self.fail_after.get(decision.replica),
        )
        self.streams.append(stream)
        return stream

    def close(self) -> None:
        for e in self.engines:
            e.shutdown()


@pytest.fixture
def replicas():
    made = []

    def make(n: int = 2, options: ServerOptions | None = None, **config):
        local = LocalReplicas(n, RoutingConfig(**config))
        made.append(local)
        client = TestClient(IngressCore(local.table, local.call, options).build_app())
        return local, client

    yield make
    for local in made:
        local.close()


def ask(client, agent: str, question: str, **extra):
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM[agent]}, {"role": "user", "content": question}],
        "max_tokens": 3,
        "temperature": 0,
        **extra,
    }
    return client.post("/v1/chat/completions", json=body)


def test_requests_pass_through_and_prefix_routing_reuses_each_replicas_cache(replicas):
    _local, client = replicas(policy="prefix")
    placed: dict[str, set] = {"A": set(), "B": set()}
    for turn in range(4):
        for agent in ("A", "B"):
            resp = ask(client, agent, f"question {turn}")
            assert resp.status_code == 200, resp.text
            placed[agent].add(resp.headers[REPLICA_HEADER])
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (cached > len(SYSTEM[agent]) - 64) == (turn > 0), (agent, turn, cached)
    assert len(placed["A"]) == len(placed["B"]) == 1 and placed["A"] != placed["B"]


def test_round_robin_spreads_an_agent_over_the_replicas(replicas):
    _local, client = replicas(policy="round_robin")
    seen = [ask(client, "A", f"q{i}").headers[REPLICA_HEADER] for i in range(4)]
    assert seen == ["r0", "r1", "r0", "r1"]


def test_error_shapes_pass_through_unchanged(replicas):
    _local, client = replicas()
    resp = client.post(
        "/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]}
    )
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"
    resp = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 3, "messages": []})
    assert resp.status_code == 400 and resp.json()["type"] == "error"  # Anthropic's shape, from the replica
    resp = client.get("/v1/models")
    assert resp.status_code == 200 and resp.json()["data"][0]["id"] == MODEL
    assert client.get("/health").json() == {"status": "ok"}
    # a body the ingress cannot read for its routing key reaches a replica, which says why
    for body, why in ((b"[" * 100_000 + b"]" * 100_000, "nests"), (b'{"a": "\xff"}', "UTF-8")):
        resp = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400 and why in resp.json()["error"]["message"], resp.text


def test_a_replica_that_dies_before_answering_gives_503(replicas):
    local, client = replicas(policy="round_robin")
    local.fail_after = {"r0": 0}
    resp = ask(client, "A", "q")  # round robin: r0 first
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "1"
    error = resp.json()["error"]
    assert error["type"] == "server_error" and "replica" in error["message"]
    assert ask(client, "A", "q").status_code == 200  # r1
    resp = client.post(
        "/v1/messages", json={"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
    )  # r0 again
    assert resp.status_code == 503
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "overloaded_error"
    assert local.table.in_flight("r0") == local.table.in_flight("r1") == 0


def sse_lines(resp) -> list[str]:
    return [line for line in resp.iter_lines() if line]


def test_a_replica_that_dies_mid_stream_ends_the_stream_with_an_error_event(replicas):
    local, client = replicas(policy="round_robin")
    local.fail_after = {"r0": 3}  # the start, then two events
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 50,
        "ignore_eos": True,
    }
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = sse_lines(resp)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: ") :])["error"]
    assert error["type"] == "server_error" and "mid-stream" in error["message"]
    assert len(lines) == 4  # two events from the replica, the error, [DONE]

    client.get("/health")  # r1: the next stream goes to r0 again
    body = {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "x"}], "stream": True}
    with client.stream("POST", "/v1/messages", json=body) as resp:
        lines = sse_lines(resp)
    assert lines[-2] == "event: error"
    assert json.loads(lines[-1][len("data: ") :])["error"]["type"] == "overloaded_error"

    client.get("/health")
    body = {"model": MODEL, "input": "x", "max_output_tokens": 50, "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as resp:
        lines = sse_lines(resp)
    error = json.loads(lines[-1][len("data: ") :])
    assert lines[-2] == "event: error" and error["type"] == "error"
    assert error["sequence_number"] == 2  # after the two events the replica sent


def test_metrics_label_each_replica_and_count_routing(replicas):
    local, client = replicas(policy="prefix")
    for turn in range(3):
        assert ask(client, "A", f"q{turn}").status_code == 200
    text = client.get("/metrics").text
    assert 'agentrt_routing_decisions_total{policy="prefix",reason="prefix"} 2.0' in text
    assert 'agentrt_replica_up{replica="r0"} 1.0' in text and 'agentrt_replica_up{replica="r1"} 1.0' in text
    prompt = [line for line in text.splitlines() if line.startswith("agentrt_prompt_tokens_total{")]
    assert sorted(p.split("{")[1].split("}")[0] for p in prompt) == ['replica="r0"', 'replica="r1"']
    local.fail_after = {"r1": 0}
    assert 'agentrt_replica_up{replica="r1"} 0.0' in client.get("/metrics").text


def test_api_keys_are_checked_at_the_ingress(replicas):
    local, client = replicas(options=ServerOptions(api_keys=("secret",)))
    assert ask(client, "A", "q").status_code == 401
    assert not local.streams  # refused before any routing
    assert client.get("/health").status_code == 200
    resp = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        headers={"Authorization": "Bearer secret"},
    )
    assert resp.status_code == 200


def test_closing_the_forwarded_stream_aborts_the_engine_request():
    engine = AsyncEngine(engine=fake_engine(max_model_len=8192, num_kv_slots=32768, record_forwards=False))
    forwarder = AsgiForwarder(create_app(engine, MODEL), "r0")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}
    request = ForwardedRequest(
        "POST",
        "/v1/chat/completions",
        headers=((b"content-type", b"application/json"),),
        body=json.dumps({**body, "ignore_eos": True, "stream": True}).encode(),
    )

    async def run() -> int:
        gen = forwarder.forward(request)
        start = await gen.__anext__()
        assert isinstance(start, ResponseStart) and start.status == 200 and start.replica == "r0"
        assert b"chat.completion.chunk" in await gen.__anext__()
        await gen.aclose()  # the ingress's client left
        for _ in range(200):  # the engine drops the request at its next step
            if not engine.engine.has_work():
                break
            await asyncio.sleep(0.05)
        return engine.engine.has_work()

    try:
        assert asyncio.run(run()) is False
    finally:
        engine.shutdown()


# ---- deployment planning and the CLI ---------------------------------------------------------


def test_resources_split_the_cpus_or_take_a_gpu_each():
    cpu = plan_resources({"CPU": 8.0}, "cpu", 2)
    assert cpu.actor_options["num_cpus"] == 4 and cpu.num_threads == 4 and not cpu.gpu
    assert cpu.actor_options["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "4"
    assert plan_resources({"CPU": 8.0}, "cpu", 2, cpus_per_replica=1).num_threads == 1
    gpu = plan_resources({"CPU": 8.0, "GPU": 2.0}, "auto", 2)
    assert gpu.gpu and gpu.actor_options["num_gpus"] == 1 and gpu.num_threads is None
    with pytest.raises(ValueError, match="needs a GPU per replica"):
        plan_resources({"CPU": 8.0, "GPU": 1.0}, "cuda", 2)
    with pytest.raises(ValueError, match="exceeds the Ray cluster's 2 CPUs"):
        plan_resources({"CPU": 2.0}, "cpu", 2, cpus_per_replica=2)
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        plan_resources({"CPU": 2.0}, "cpu", 0)


def test_the_replica_spec_gets_the_thread_budget_or_the_gpu():
    from agentrt.runtime.config import EngineConfig, ModelConfig

    spec = ReplicaSpec(EngineConfig(model=ModelConfig(device="cuda:1")), MODEL)
    assert (
        replica_spec(spec, plan_resources({"CPU": 4.0, "GPU": 2.0}, "cuda:1", 2)).config.model.device
        == "cuda"
    )
    spec = ReplicaSpec(EngineConfig(model=ModelConfig(device="cpu")), MODEL)
    assert replica_spec(spec, plan_resources({"CPU": 4.0}, "cpu", 2)).config.model.threads == 2
    spec = ReplicaSpec(EngineConfig(model=ModelConfig(device="cpu", threads=1)), MODEL)
    assert replica_spec(spec, plan_resources({"CPU": 4.0}, "cpu", 2)).config.model.threads == 1


def test_scale_out_flags_without_replicas_are_refused(capsys):
    from agentrt.cli import main

    assert main(["serve", "--routing", "round_robin"]) == 2
    assert "need --replicas N > 1 or --ray-address" in capsys.readouterr().err


def test_a_replica_count_below_one_is_refused_before_ray_starts(monkeypatch, capsys):
    from agentrt.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # Ray is never reached
    assert main(["serve", "--replicas", "0"]) == 2
    assert "--replicas must be >= 1, got 0" in capsys.readouterr().err


def test_replicas_without_ray_serve_say_how_to_install(monkeypatch, capsys):
    from agentrt.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["serve", "--replicas", "2"]) == 2
    assert SERVE_INSTALL_HINT in capsys.readouterr().err
