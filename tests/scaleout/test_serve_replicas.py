"""`agentrt serve --replicas 2` for real: a local Ray cluster started here (2 CPUs, no dashboard), the
Serve application of agentrt/scaleout/deploy.py with 2 CPU replicas of one thread each, reached
over HTTP through Serve's proxy.

- the API through the replicas (default model): a JSON-schema-constrained request, a streamed tool
  call with the openai client, error shapes, /metrics labelled by replica;
- routing (a tiny random-weight model: only the prefix cache matters): two agents with different
  ~1,500-token system prompts, 8 requests each, interleaved A B B A ...: under `prefix` each agent's
  requests stay on one replica and all but its first report cached_tokens > 1,000; under
  `round_robin` every agent visits both replicas and some later request misses the cache;
- a replica process killed (SIGKILL) mid-stream: its streams end with an error event and [DONE],
  not a hang; the other replica's streams go on; later requests succeed; Serve starts a new one.

Everything here takes minutes on 2 busy cores (Ray's start alone 30-60 s): marked slow. The Ray
cluster may fail to start on a loaded machine (its raylet gives the dashboard agent a fixed 15 s):
the tests then skip saying so. GPU replicas (num_gpus=1) are not tested here: no GPU.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from agentrt.api.middleware import ServerOptions
from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
from agentrt.scaleout.deploy import (
    APP_NAME,
    ENGINE_DEPLOYMENT,
    build_application,
    plan_resources,
    replica_options,
    replica_spec,
)
from agentrt.scaleout.ingress import REPLICA_HEADER
from agentrt.scaleout.policy import RoutingConfig
from agentrt.scaleout.replica import ReplicaSpec
from agentrt.testing import free_port
from tests.support.models import make_tiny_model
from tests.support.ray_cluster import start_local_ray

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TRIES = 6
"""ray.init attempts (each up to ~60 s on a loaded machine) before the tests skip."""


@pytest.fixture(scope="module")
def cluster():
    """(ray, base URL of Serve's proxy)."""
    ray = start_local_ray("ray.serve", tries=TRIES, object_store_bytes=300 << 20)
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield ray, f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def deploy(ray, model: str, policy: str = "prefix", kv_cache_bytes: int = 128 << 20) -> None:
    """(Re)deploy the app: 2 CPU replicas of `model` (one thread each), routing `policy`."""
    from ray import serve

    serve.delete(APP_NAME)  # free the CPUs of the previous replicas first
    config = EngineConfig(
        model=ModelConfig(model=model, device="cpu", dtype="float32"),
        cache=CacheConfig(kv_cache_bytes=kv_cache_bytes),
    )
    resources = plan_resources(ray.cluster_resources(), "cpu", 2)
    spec = replica_spec(ReplicaSpec(config, MODEL, options=replica_options(ServerOptions())), resources)
    app = build_application(spec, 2, RoutingConfig(policy=policy), ServerOptions(), resources)
    serve.run(app, name=APP_NAME, route_prefix="/")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    """A 2-layer random-weight Llama with the default model's tokenizer and a 4,096-token context."""
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("tiny"), default_model_dir, "llama", max_position_embeddings=4096
        )
    )


# ---- the API through the replicas ------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_the_api_passes_through_two_replicas(cluster, default_model_dir):
    import jsonschema
    import openai

    ray, url = cluster
    deploy(ray, str(default_model_dir))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)

    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Extract: Tran Van Bao, 31, lives in Hue."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        temperature=0,
        max_tokens=40,
    )
    jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)

    calls: dict[int, dict] = {}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
        temperature=0,
        max_tokens=40,
    )
    finish = None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert isinstance(json.loads(calls[0]["arguments"])["city"], str)
    assert finish in ("tool_calls", "stop")

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert e.value.body["code"] == "model_not_found"
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}},
            max_tokens=2,
        )
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"]

    metrics = httpx.get(f"{url}/metrics", timeout=60).text
    up = [line for line in metrics.splitlines() if line.startswith("agentrt_replica_up{")]
    assert len(up) == 2 and all(line.endswith(" 1.0") for line in up), up
    assert "agentrt_routing_decisions_total{" in metrics


# ---- routing ---------------------------------------------------------------------------------

VERBS = ["check", "archive", "verify", "summarise", "escalate", "compare", "record", "approve", "reject"]
NOUNS = ["invoice", "ticket", "order", "refund", "contract", "shipment", "report", "account", "claim"]


def system_prompt(agent: str, num_rules: int = 63) -> str:
    """A long system prompt of its own per agent (~24 tokens per rule with the default tokenizer)."""
    rng = random.Random(agent)
    rules = [
        f"Rule {i}: agent {agent} must {rng.choice(VERBS)} every {rng.choice(NOUNS)} numbered "
        f"{rng.randrange(10_000)} before step {rng.randrange(100)}."
        for i in range(num_rules)
    ]
    return f"You are agent {agent}.\n" + "\n".join(rules)


def run_interleaved(url: str) -> dict[str, list[tuple[str, int]]]:
    """Two agents, 8 questions each, in the order A B B A A B B A ...: per agent (replica, cached
    tokens) of each answer."""
    out: dict[str, list[tuple[str, int]]] = {"A": [], "B": []}
    order = ["A", "B", "B", "A"] * 4
    asked = {"A": 0, "B": 0}
    with httpx.Client(base_url=url, timeout=300) as client:
        for agent in order:
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": system_prompt(agent)},
                    {"role": "user", "content": f"Question {asked[agent]}: what is rule {asked[agent]}?"},
                ],
                "max_tokens": 2,
                "temperature": 0,
            }
            asked[agent] += 1
            resp = client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            out[agent].append((resp.headers[REPLICA_HEADER], cached))
    return out


def test_prefix_routing_keeps_each_agent_on_the_replica_that_caches_it(cluster, tiny_model, tokenizer):
    for agent in ("A", "B"):
        assert 1400 < len(tokenizer.encode(system_prompt(agent))) < 1700
    ray, url = cluster

    deploy(ray, tiny_model, "prefix", kv_cache_bytes=64 << 20)
    placed = run_interleaved(url)
    for agent, answers in placed.items():
        assert len({replica for replica, _ in answers}) == 1, (agent, answers)
        assert all(cached > 1000 for _, cached in answers[1:]), (agent, answers)
    assert placed["A"][0][0] != placed["B"][0][0]

    deploy(ray, tiny_model, "round_robin", kv_cache_bytes=64 << 20)
    placed = run_interleaved(url)
    for agent, answers in placed.items():
        assert len({replica for replica, _ in answers}) == 2, (agent, answers)
        assert any(cached <= 1000 for _, cached in answers[1:]), (agent, answers)


# ---- faults ----------------------------------------------------------------------------------


class StreamReader(threading.Thread):
    """Streams one long chat completion; records the replica, the SSE data lines, and how it ended.
    After `stop_after` data lines beyond those read when `release` is set, it stops reading."""

    def __init__(self, url: str, n: int):
        super().__init__(daemon=True)
        self.url, self.n = url, n
        self.replica: str | None = None
        self.lines: list[str] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.outcome: str | None = None  # "done", "error", "stopped", or an exception's name

    def run(self) -> None:
        body = {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": f"Stream {self.n}: " + "tell me a long story. " * (self.n + 1)}
            ],
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=120) as resp:
                self.replica = resp.headers.get(REPLICA_HEADER)
                seen_at_release = None
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    self.lines.append(line)
                    self.started.set()
                    if '"error"' in line:
                        self.outcome = "error"
                    elif line == "data: [DONE]":
                        self.outcome = self.outcome or "done"
                        return
                    if self.release.is_set():
                        seen_at_release = seen_at_release or len(self.lines)
                        if len(self.lines) - seen_at_release >= 5 and self.outcome is None:
                            self.outcome = "stopped"
                            return
        except Exception as e:  # noqa: BLE001 (the outcome says what went wrong)
            self.outcome = type(e).__name__
        finally:
            self.started.set()


def replica_pid(ray, replica: str) -> tuple[int, object]:
    """The pid and actor handle of the engine replica with Serve id `replica`."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].endswith(f"#{ENGINE_DEPLOYMENT}#{replica}"):
            actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
            return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60), actor
    raise AssertionError(f"no actor for replica {replica}")


def running_engine_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT]
    return deployment.replica_states.get("RUNNING", 0)


def test_a_killed_replica_fails_its_streams_and_comes_back(cluster, tiny_model):
    ray, url = cluster
    deploy(ray, tiny_model, "least_loaded", kv_cache_bytes=64 << 20)
    readers = [StreamReader(url, n) for n in range(4)]
    for r in readers:
        r.start()
        r.started.wait(timeout=180)
    assert all(r.replica for r in readers), [(r.replica, r.outcome) for r in readers]
    victim = readers[0].replica
    assert len({r.replica for r in readers}) == 2  # least_loaded spread the four streams
    pid, _ = replica_pid(ray, victim)
    os.kill(pid, signal.SIGKILL)
    for r in readers:
        r.release.set()
    for r in readers:
        r.join(timeout=120)
        assert not r.is_alive(), f"stream {r.n} on {r.replica} hung"
    for r in readers:
        if r.replica == victim:
            assert r.outcome == "error" and r.lines[-1] == "data: [DONE]", (r.n, r.outcome, r.lines[-2:])
            assert "mid-stream" in json.loads(r.lines[-2][len("data: ") :])["error"]["message"]
        else:
            assert r.outcome == "stopped", (r.n, r.outcome, r.lines[-2:])  # it went on after the kill

    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(4):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"after {i}"}], "max_tokens": 3}
            resp = client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.headers[REPLICA_HEADER] != victim

    deadline = time.monotonic() + 300
    while True:  # Serve starts a new replica (a new id); the router sees it, it answers its scrape
        metrics = httpx.get(f"{url}/metrics", timeout=60).text
        up = [line for line in metrics.splitlines() if line.startswith("agentrt_replica_up{")]
        if len(up) == 2 and all(line.endswith(" 1.0") and victim not in line for line in up):
            break
        assert time.monotonic() < deadline, f"Serve did not replace the killed replica in 300 s: {up}"
        time.sleep(2)
    assert running_engine_replicas() == 2
