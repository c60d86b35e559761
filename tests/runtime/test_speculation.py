"""Speculative decoding through the engine: exactness (greedy identity, sampling distribution),
grammar composition, metrics and per-request opt-out."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import SamplingParams
from agentrt.runtime.speculation import SHIPPED_HEADS
from tests.support.models import chat_ids, make_tiny_model

HEADS = SHIPPED_HEADS / "smollm2-135m-instruct"
METHODS = {
    "ngram": SpecConfig(method="ngram", num_speculative_tokens=4),
    "draft": SpecConfig(method="draft", num_speculative_tokens=3, draft_layers=8),
    "medusa": SpecConfig(method="medusa", medusa_heads=str(HEADS)),
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TICKET = {
    "type": "object",
    "properties": {"status": {"enum": ["open", "closed", "pending"]}, "note": {"type": ["string", "null"]}},
    "required": ["status"],
    "additionalProperties": False,
}


def spec_engine(model_dir, spec: SpecConfig, **cache) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), device="cpu", dtype="float32"),
            cache=CacheConfig(kv_cache_bytes=64 << 20, **cache),
            speculative=spec,
        )
    )


def greedy_requests(tokenizer):
    prompts = [
        "Repeat exactly: red, green, blue, red, green, blue, red, green, blue.",
        "Write a JSON object for a person named Ada aged 36.",
        "Explain what a hash table is.",
    ]
    # 20 tokens: the constrained request closes its JSON and stops at 16 (measured), the others
    # are cut by max_tokens (with speculation: drafts cut by the remaining budget)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    reqs = [(chat_ids(tokenizer, [{"role": "user", "content": p}]), params, None) for p in prompts]
    reqs.append(
        (
            chat_ids(tokenizer, [{"role": "user", "content": prompts[1]}]),
            params,
            ConstraintSpec.json_schema(PERSON),
        )
    )
    return reqs


@pytest.fixture(scope="module")
def reference(engine, tokenizer):
    reqs = greedy_requests(tokenizer)
    return reqs, [o.token_ids for o in engine.generate(reqs)]


@pytest.fixture(scope="module")
def spec_engines(default_model_dir):
    """One engine per method in METHODS, made on first use and shared by the tests of this module
    (the greedy identity test runs first, on an empty prefix cache)."""
    engines: dict[str, Engine] = {}

    def get(method: str) -> Engine:
        if method == "medusa" and not (HEADS / "config.json").exists():
            pytest.fail(f"the shipped Medusa heads are missing from {HEADS}")
        if method not in engines:
            engines[method] = spec_engine(default_model_dir, METHODS[method])
        return engines[method]

    yield get
    for eng in engines.values():
        eng.grammar.shutdown()


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_is_token_identical_batched_cold_and_warm_cache(spec_engines, reference, method):
    reqs, want = reference
    eng = spec_engines(method)
    assert eng.stats.num_spec_steps == 0 and eng.scheduler.cache.total_tokens == 0  # a fresh engine
    cold = [o.token_ids for o in eng.generate(reqs)]  # all four in one batch, empty prefix cache
    warm = [o.token_ids for o in eng.generate(reqs)]  # every prompt now cached
    assert cold == want
    assert warm == want
    s = eng.stats
    assert s.num_spec_steps > 0 and s.num_draft_tokens > 0
    if method != "draft":  # the untrained 8-layer self-draft rarely matches
        assert s.num_accepted_tokens > 0
    # no KV slot leaks: every slot is free or held by the radix tree (rejected drafts returned)
    assert eng.runner.kv.num_free + eng.scheduler.cache.total_tokens == eng.runner.kv.num_slots


def test_greedy_identity_with_a_separate_draft_model(default_model_dir, reference, tmp_path):
    """A second model with the same tokenizer (a tiny random one: it rarely agrees, but every
    step still drafts, verifies and rolls its own KV back)."""
    reqs, want = reference
    tiny = make_tiny_model(tmp_path / "draft", default_model_dir, "llama")
    eng = spec_engine(
        default_model_dir, SpecConfig(method="draft", draft_model=str(tiny), num_speculative_tokens=2)
    )
    assert [o.token_ids for o in eng.generate(reqs)] == want
    assert eng.stats.num_spec_steps > 0
    draft_kv = eng.speculator.draft.kv
    assert draft_kv.num_free == draft_kv.num_slots  # finished requests returned their draft KV
    eng.grammar.shutdown()


@pytest.mark.parametrize("method", list(METHODS))
def test_constrained_outputs_stay_valid_at_concurrency_8(spec_engines, tokenizer, method):
    """Schema with an enum and an optional nullable string; 8 requests at once, greedy and
    sampled, length-safe policy. Drafts the grammar rejects are cut before verification (the real
    matcher never sees them: a rejected token would end the request with an error). The engine is
    the greedy test's: the counters are compared with their values before these requests."""
    eng = spec_engines(method)
    spec_steps, cut = eng.stats.num_spec_steps, eng.stats.num_draft_tokens_cut_by_grammar
    doc = (
        "Ticket 4411: printer on floor 3 jams. Status: open. Ticket 4412: VPN drops. Status: closed. "
        "Ticket 4413: new laptop. Status: pending. "
    ) * 2
    reqs = []
    for i in range(8):
        msgs = [
            {"role": "system", "content": "Reply with JSON: " + json.dumps(TICKET)},
            {"role": "user", "content": f"{doc}\nWhat is the status of ticket 441{i % 3 + 1}? Add a note."},
        ]
        params = SamplingParams(
            max_tokens=48, temperature=0.0 if i < 4 else 0.9, seed=i, max_tokens_policy="close"
        )
        reqs.append((chat_ids(tokenizer, msgs), params, ConstraintSpec.json_schema(TICKET)))
    outs = eng.generate(reqs)
    for o in outs:
        assert o.error is None and o.finish_reason == "stop", (o.error, o.text)
        jsonschema.validate(json.loads(o.text), TICKET)
    assert eng.stats.num_spec_steps > spec_steps
    if method == "ngram":  # prompt lookup proposes document text: the grammar must cut some
        assert eng.stats.num_draft_tokens_cut_by_grammar > cut


# ---- distribution (temperature 1) --------------------------------------------------------------


def two_sample_p(a: list[int], b: list[int]) -> float:
    """Chi-square homogeneity p-value of two equal-size samples of token ids (cells with fewer
    than 10 observations in both samples together are merged)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    cells, rest_a, rest_b = [], 0, 0
    for t in set(ca) | set(cb):
        if ca[t] + cb[t] >= 10:
            cells.append((ca[t], cb[t]))
        else:
            rest_a, rest_b = rest_a + ca[t], rest_b + cb[t]
    if rest_a + rest_b:
        cells.append((rest_a, rest_b))
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def peaked_tiny_model(tmp_path_factory, default_model_dir):
    """A 2-layer random model with peaked, context-dependent next-token distributions that every
    proposer can sometimes guess: tied embeddings of std 0.1 make "repeat the current token" likely
    (p ~ 0.8 under top_k 8); layer 0 adds nothing (o_proj, down_proj zero), so the 1-layer
    self-draft is a bigram model while the target's layer 1 still mixes in the context (q != p).
    Medusa heads start as identity blocks, proposing the current next-token top-k."""
    from transformers import AutoModelForCausalLM

    from agentrt.speculative.medusa import MedusaHeads

    path = make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", default_model_dir, "llama", tie_word_embeddings=True
    )
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        torch.manual_seed(5)
        model.model.embed_tokens.weight.normal_(0.0, 0.1)
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
    model.save_pretrained(str(path))
    heads = tmp_path_factory.mktemp("heads")
    MedusaHeads(64, 49152, num_heads=3).save(heads, dtype=torch.float32)
    return path, heads


@pytest.mark.slow  # 3.5 min on 2 cores; run with `make test-slow`
@pytest.mark.parametrize("method", ["plain", "ngram", "draft", "medusa"])
def test_sampling_distribution_matches_non_speculative(peaked_tiny_model, method):
    """Temperature 1, top_k 8: the first 3 sampled tokens over 1500 seeds, speculative vs plain
    (chi-square per position at alpha = 1e-3; seeded, so deterministic). "plain" checks that the
    test detects a different distribution (temperature 1.4)."""
    path, heads = peaked_tiny_model
    spec = {
        "plain": SpecConfig(),
        "ngram": SpecConfig(method="ngram", num_speculative_tokens=3, ngram_max=2),
        "draft": SpecConfig(method="draft", num_speculative_tokens=3, draft_layers=1),
        "medusa": SpecConfig(method="medusa", medusa_heads=str(heads)),
    }[method]
    n = 1500
    prompt = [1000, 2000, 3000, 1000, 2000, 3000, 1000, 2000]

    def run(cfg: SpecConfig, temperature: float = 1.0):
        eng = Engine(
            EngineConfig(
                model=ModelConfig(model=str(path), device="cpu", dtype="float32"),
                cache=CacheConfig(kv_cache_bytes=16 << 20),
                scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096),
                speculative=cfg,
            )
        )
        params = [
            SamplingParams(max_tokens=6, temperature=temperature, top_k=8, seed=s, ignore_eos=True)
            for s in range(n)
        ]
        outs = eng.generate([(prompt, p, None) for p in params])
        eng.grammar.shutdown()
        return [o.token_ids[:3] for o in outs], eng.stats

    base, _ = run(SpecConfig())
    if method == "plain":
        other, _ = run(SpecConfig(), temperature=1.4)
        assert min(two_sample_p([b[i] for b in base], [o[i] for o in other]) for i in range(3)) < 1e-3
        return
    got, stats = run(spec)
    assert stats.num_spec_steps > 0
    if method != "ngram":
        assert stats.num_accepted_tokens > 0
    for i in range(3):
        assert two_sample_p([b[i] for b in base], [g[i] for g in got]) > 1e-3, f"position {i}"


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_medusa_over_a_quantized_lm_head(peaked_tiny_model, tmp_path, quantization):
    """With --quantize-lm-head the target's LM head is a packed-weight module with no dense weight;
    shared-head Medusa drafts through the module itself, and greedy decoding stays token-identical
    to the same quantized model without speculation."""
    path, heads = peaked_tiny_model

    def run(spec: SpecConfig):
        eng = Engine(
            EngineConfig(
                model=ModelConfig(
                    model=str(path),
                    device="cpu",
                    dtype="float32",
                    quantization=quantization,
                    quant_group_size=32,
                    quantize_lm_head=True,
                    cache_dir=tmp_path,
                ),
                cache=CacheConfig(kv_cache_bytes=16 << 20),
                speculative=spec,
            )
        )
        prompts = [[1000, 2000, 3000, 1000, 2000, 3000, 1000], [7, 8, 9, 10, 7, 8, 9]]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        outs = eng.generate([(p, params, None) for p in prompts])
        eng.grammar.shutdown()
        return [o.token_ids for o in outs], eng.stats

    plain, _ = run(SpecConfig())
    medusa, stats = run(SpecConfig(method="medusa", medusa_heads=str(heads)))
    assert medusa == plain
    assert stats.num_spec_steps > 0


def _draft_engine(path) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(model=str(path), device="cpu", dtype="float32"),
            cache=CacheConfig(kv_cache_bytes=16 << 20, enable_prefix_cache=False),
            speculative=SpecConfig(method="draft", num_speculative_tokens=3, draft_layers=1),
        )
    )


_FAULT_PROMPTS = [
    [1000, 2000, 3000, 1000, 2000],
    [2000, 3000, 1000, 2000, 3000],
    [3000, 1000, 2000, 3000, 1000],
]


def _constrained(eng: Engine):
    spec = ConstraintSpec.regex("[a-c]{4,60}")
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = eng.generate([(p, params, spec) for p in _FAULT_PROMPTS])
    return outs


def test_a_draft_model_fault_fails_that_request_alone(peaked_tiny_model):
    """A draft model drafts the batch together; one request's drafting raising (its matcher, its
    sampling) fails that request alone, and the others finish exactly as without the fault."""
    path, _ = peaked_tiny_model
    clean_eng = _draft_engine(path)
    clean = _constrained(clean_eng)
    clean_eng.grammar.shutdown()
    eng = _draft_engine(path)
    draft_token, calls = eng.speculator.draft._draft_token, []

    def draft_or_raise(st, *a, **kw):
        if st["r"].prompt_ids == _FAULT_PROMPTS[1]:
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("injected matcher fault")
        return draft_token(st, *a, **kw)

    eng.speculator.draft._draft_token = draft_or_raise
    faulty = _constrained(eng)
    assert faulty[1].finish_reason == "error" and "speculative drafting" in faulty[1].error.message
    for i in (0, 2):
        assert faulty[i].error is None and faulty[i].token_ids == clean[i].token_ids
    assert eng.stats.num_spec_steps > 0
    assert not eng.has_work() and eng.runner.kv.num_free == eng.runner.kv.num_slots
    assert eng.speculator.draft.kv.num_free == eng.speculator.draft.kv.num_slots
    eng.grammar.shutdown()


def test_a_failing_draft_forward_leaves_the_step_without_drafts(peaked_tiny_model, monkeypatch):
    """The draft model's forward raising ends drafting for that step (matchers rolled back); every
    request still finishes with the tokens it has without the fault."""
    from agentrt.runtime import speculation

    path, _ = peaked_tiny_model
    clean_eng = _draft_engine(path)
    clean = _constrained(clean_eng)
    clean_eng.grammar.shutdown()
    real, calls = speculation.run_chunks, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) % 4 == 3:
            raise RuntimeError("injected draft forward fault")
        return real(*a, **kw)

    monkeypatch.setattr(speculation, "run_chunks", flaky)
    eng = _draft_engine(path)
    outs = _constrained(eng)
    assert len(calls) >= 3
    assert [o.error for o in outs] == [None] * 3
    assert [o.token_ids for o in outs] == [o.token_ids for o in clean]
    assert not eng.has_work() and eng.runner.kv.num_free == eng.runner.kv.num_slots
    assert eng.speculator.draft.kv.num_free == eng.speculator.draft.kv.num_slots
    eng.grammar.shutdown()


# ---- configuration, CLI, API field, training ------------------------------------------------------


def test_cli_flags_and_request_field():
    import argparse

    from agentrt.api.protocol import ChatCompletionRequest
    from agentrt.engine_args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config(
        p.parse_args(
            ["--speculative-method", "draft", "--draft-layers", "12", "--num-speculative-tokens", "6"]
        )
    )
    assert cfg.speculative == SpecConfig(method="draft", draft_layers=12, num_speculative_tokens=6)
    cfg = engine_config(
        p.parse_args(
            ["--speculative-method", "medusa", "--medusa-heads", "h", "--speculative-acceptance", "typical"]
        )
    )
    assert cfg.speculative == SpecConfig(method="medusa", medusa_heads="h", acceptance="typical")
    assert engine_config(p.parse_args([])).speculative.method is None
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], speculative=False)
    assert req.sampling_params(8).speculative is False


def test_invalid_speculation_settings_are_clear_errors(tmp_path, default_model_dir):
    with pytest.raises(ValueError, match="ngram, draft or medusa"):
        SpecConfig(method="eagle")
    with pytest.raises(ValueError, match="draft_model or draft_layers"):
        SpecConfig(method="draft")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="typical' applies to Medusa only"):
        SpecConfig(method="ngram", acceptance="typical")
    tiny = make_tiny_model(tmp_path / "m", default_model_dir, "llama")
    with pytest.raises(ValueError, match="no Medusa heads are shipped .* --medusa-heads"):
        spec_engine(tiny, SpecConfig(method="medusa"))
    for layers in (0, 2):
        with pytest.raises(ValueError, match=r"draft_layers must be in \[1, 1\]"):
            spec_engine(tiny, SpecConfig(method="draft", draft_layers=layers))
    with pytest.raises(ValueError, match="needs"):  # heads for another hidden size
        spec_engine(tiny, SpecConfig(method="medusa", medusa_heads=str(HEADS)))
    other = make_tiny_model(tmp_path / "o", default_model_dir, "llama", vocab_size=50000)
    with pytest.raises(ValueError, match="draft model vocabulary"):
        spec_engine(tiny, SpecConfig(method="draft", draft_model=str(other)))


def test_train_medusa_writes_loadable_heads(tmp_path, default_model_dir):
    import argparse

    from agentrt.speculative.medusa import MedusaHeads
    from agentrt.train_medusa import train_medusa

    tiny = make_tiny_model(tmp_path / "m", default_model_dir, "llama")
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"Count to {i}."}]} for i in range(3)]
    lines.append({"prompt": "Ticket 7: open.", "schema": TICKET})
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "heads"
    args = argparse.Namespace(
        prompts=str(prompts),
        output=str(out),
        num_heads=2,
        max_tokens=12,
        epochs=1,
        lr=1e-3,
        batch_size=16,
        seed=0,
    )
    cfg = EngineConfig(
        model=ModelConfig(model=str(tiny), device="cpu"), cache=CacheConfig(kv_cache_bytes=8 << 20)
    )
    record = train_medusa(cfg, args, log=lambda *_: None)
    assert record["num_prompts"] == 4 and record["num_positions"] > 0 and len(record["holdout_top1"]) == 2
    heads = MedusaHeads.load(out, 64, 49152)
    assert heads.num_heads == 2 and heads.shared_lm_head
    assert json.loads((out / "config.json").read_text())["training"]["epochs"] == 1
    eng = spec_engine(tiny, SpecConfig(method="medusa", medusa_heads=str(out)))
    assert eng.generate([([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0), None)])[0].finish_reason
    eng.grammar.shutdown()
    prompts.write_text('{"messages": [{"role": "user", "content": "x"}]}\nnot json\n')
    with pytest.raises(ValueError, match="prompts.jsonl:2: not JSON"):
        train_medusa(cfg, args, log=lambda *_: None)


@pytest.mark.slow
def test_shipped_medusa_heads_accept_over_1_5_tokens_per_pass_on_extraction(default_model_dir):
    """The shipped heads on 4 extraction documents they were not trained on (odd positions of
    docs.jsonl), greedy, JSON Schema constrained: mean accepted length > 1.5."""
    from tests.support.paths import shared_path

    docs_path = shared_path("extraction", "docs.jsonl")
    from agentrt.extract.prompt import extraction_messages

    docs = [json.loads(line) for line in docs_path.read_text().splitlines()][1::2][:4]
    schemas = {p.stem: json.loads(p.read_text()) for p in (docs_path.parent / "schemas").glob("*.json")}
    eng = spec_engine(default_model_dir, SpecConfig(method="medusa", medusa_heads=str(HEADS)))
    tok = eng.tokenizer
    reqs = []
    for d in docs:
        schema = schemas[d["schema_name"]]
        text = tok.apply_chat_template(
            extraction_messages(d["text"], schema), add_generation_prompt=True, tokenize=False
        )
        reqs.append(
            (
                tok.encode(text, add_special_tokens=False),
                SamplingParams(max_tokens=128, temperature=0.0),
                ConstraintSpec.json_schema(schema),
            )
        )
    outs = eng.generate(reqs)
    assert all(o.error is None for o in outs)
    s = eng.stats
    assert (s.num_accepted_tokens + s.num_spec_steps) / s.num_spec_steps > 1.5
    eng.grammar.shutdown()
