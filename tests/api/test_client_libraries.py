"""Structured-output client libraries, unchanged, against a real `agentrt serve` on the default model:
outlines (`from_openai`, `from_vllm`, `from_sglang`), instructor (TOOLS and JSON_SCHEMA modes),
LlamaIndex's `OpenAILike` and LiteLLM. Each test makes one structured call through the library's
own API (temperature 0, a small max_tokens) and checks the result against the schema or regex it
asked for: the 135M model's values may be poor, but they must be valid. A missing package skips its
test and says which.

What each library sends (read from its source, seen in the server's request log):
- outlines.from_openai: response_format json_schema, strict true, additionalProperties false added.
  Its `Regex` output type is refused by outlines itself (OpenAI has no regex), so the regex test
  goes through a pydantic `pattern`, which outlines passes on.
- outlines.from_vllm: vLLM's `structured_outputs` {"json": schema} / {"regex": ...} /
  {"grammar": lark} in the body; outlines.from_sglang: response_format / `regex` / `ebnf`.
- instructor TOOLS: one tool and a named tool_choice; JSON_SCHEMA: response_format json_schema.
- LlamaIndex OpenAILike (function calling): one tool, tool_choice "required",
  parallel_tool_calls false; with should_use_structured_outputs: response_format json_schema.
- LiteLLM ("openai/" provider): response_format json_schema (from a pydantic model or a dict).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import regex
from pydantic import BaseModel, Field

MODEL = "smollm2-135m-instruct"
PROMPT = "Extract the person: Tran Van Bao, 31, lives in Hue."
PHONE = r"[0-9]{3}-[0-9]{4}"


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=20)
    age: int


class Phone(BaseModel):
    number: str = Field(pattern=f"^{PHONE}$")


def _check_json(text: str | None, model: type[BaseModel]) -> BaseModel:
    """`text` parsed as JSON, valid against `model`'s JSON Schema (jsonschema) and the model itself."""
    assert text is not None
    jsonschema.validate(json.loads(text), model.model_json_schema())
    return model.model_validate_json(text)


def _check_object(obj: object, model: type[BaseModel]) -> None:
    """A library's parsed result: an instance of `model` whose dump is valid against its schema."""
    assert isinstance(obj, model), obj
    jsonschema.validate(obj.model_dump(mode="json"), model.model_json_schema())


def _openai_client(server: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="none")


# --- outlines ----------------------------------------------------------------------------------


def _outlines():
    return pytest.importorskip("outlines", reason="outlines is not installed (pip install outlines)")


def test_outlines_from_openai_pydantic(server):
    outlines = _outlines()
    model = outlines.from_openai(_openai_client(server), MODEL)
    _check_json(model(PROMPT, Person, temperature=0, max_tokens=40), Person)


def test_outlines_from_openai_pattern(server):
    outlines = _outlines()
    model = outlines.from_openai(_openai_client(server), MODEL)
    phone = _check_json(model("Give a phone number.", Phone, temperature=0, max_tokens=30), Phone)
    assert regex.fullmatch(PHONE, phone.number)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_outlines_server_backends_pydantic(server, backend):
    outlines = _outlines()
    model = getattr(outlines, f"from_{backend}")(_openai_client(server), MODEL)
    _check_json(model(PROMPT, Person, temperature=0, max_tokens=40), Person)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_outlines_server_backends_regex(server, backend):
    outlines = _outlines()
    from outlines.types import Regex

    model = getattr(outlines, f"from_{backend}")(_openai_client(server), MODEL)
    out = model("Give a phone number.", Regex(PHONE), temperature=0, max_tokens=20)
    assert regex.fullmatch(PHONE, out), out


def test_outlines_from_vllm_lark_grammar(server):
    """outlines' CFG is a Lark grammar; from_vllm sends it as structured_outputs.grammar, which
    agentrt reads as Lark (no `::=` rule), as vLLM does."""
    outlines = _outlines()
    import lark
    from outlines.types import CFG

    grammar = 'start: "The answer is " NUMBER\n%import common.NUMBER\n'
    model = outlines.from_vllm(_openai_client(server), MODEL)
    out = model("What is 2 + 2?", CFG(grammar), temperature=0, max_tokens=10)
    lark.Lark(grammar, parser="lalr").parse(out)  # raises unless the output is in the language


# --- instructor --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(server, mode):
    instructor = pytest.importorskip(
        "instructor", reason="instructor is not installed (pip install instructor)"
    )
    client = instructor.from_openai(_openai_client(server), mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(
        model=MODEL,
        response_model=Person,
        max_retries=0,  # a wrong answer fails here instead of being re-asked
        temperature=0,
        max_tokens=60,
        messages=[{"role": "user", "content": PROMPT}],
    )
    _check_object(person, Person)


# --- LlamaIndex --------------------------------------------------------------------------------


def _llama_index_llm(server: str, **kwargs):
    pytest.importorskip(
        "llama_index.llms.openai_like",
        reason="llama-index-llms-openai-like is not installed (pip install llama-index-llms-openai-like)",
    )
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(
        model=MODEL,
        api_base=f"{server}/v1",
        api_key="none",
        is_chat_model=True,
        context_window=8192,
        temperature=0,
        max_tokens=60,
        **kwargs,
    )


def test_llama_index_function_calling_structured_predict(server):
    llm = _llama_index_llm(server, is_function_calling_model=True)
    from llama_index.core import PromptTemplate

    person = llm.structured_predict(Person, PromptTemplate("Extract the person: {text}"), text=PROMPT)
    _check_object(person, Person)


def test_llama_index_structured_outputs(server):
    llm = _llama_index_llm(server, is_function_calling_model=False, should_use_structured_outputs=True)
    from openai.resources.chat.completions import completions

    if not hasattr(completions, "_type_to_response_format"):
        # llama-index-llms-openai imports this private helper of openai<3 (it pins openai<3)
        pytest.skip("llama-index-llms-openai's structured outputs need openai<3 (its own pin)")
    from llama_index.core import PromptTemplate

    person = llm.structured_predict(Person, PromptTemplate("Extract the person: {text}"), text=PROMPT)
    _check_object(person, Person)


# --- LiteLLM -----------------------------------------------------------------------------------


@pytest.mark.parametrize("as_dict", [False, True], ids=["pydantic", "json_schema_dict"])
def test_litellm_response_format(server, monkeypatch, as_dict):
    # no network: the bundled model cost map, and nothing else LiteLLM would fetch by itself
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("LITELLM_OFFLINE_MODE", "true")
    litellm = pytest.importorskip("litellm", reason="litellm is not installed (pip install litellm)")
    response_format = (
        {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}}
        if as_dict
        else Person
    )
    resp = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=f"{server}/v1",
        api_key="none",
        messages=[{"role": "user", "content": PROMPT}],
        response_format=response_format,
        temperature=0,
        max_tokens=60,
    )
    assert resp.choices[0].finish_reason == "stop", resp
    _check_json(resp.choices[0].message.content, Person)
