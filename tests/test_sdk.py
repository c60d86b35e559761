"""Python SDK in-process: generate, chat, and structured extraction into dicts and pydantic models."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import BaseModel

from agentrt import LLM, SamplingParams
from agentrt.errors import ConstraintError, IncompleteOutputError


class City(BaseModel):
    city: str
    country: str


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), device="cpu", kv_cache_bytes=64 << 20)


def test_generate_and_chat(llm):
    outs = llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(temperature=0, max_tokens=5))
    assert len(outs) == 2 and all(o.text and len(o.token_ids) <= 5 for o in outs)
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=10))
    assert chat[0].text


def test_extract_into_pydantic_and_dict(llm):
    obj = llm.extract("Lyon is a city in France.", City)
    assert isinstance(obj, City) and obj.city
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
    }
    objs = llm.extract(["Pick a digit.", [{"role": "user", "content": "Another digit?"}]], schema)
    assert len(objs) == 2
    for o in objs:
        jsonschema.validate(o, schema)


def test_extract_rejects_a_non_schema(llm):
    with pytest.raises(ValueError, match="not a valid JSON Schema"):
        llm.extract("x", {"type": 5})
    with pytest.raises(ValueError, match="pydantic model class"):
        llm.extract("x", 42)


def test_extract_raises_the_typed_error_the_api_gives(llm):
    # the schema is valid but `uniqueItems` over numbers cannot be enforced: the error names the
    # keyword and its pointer
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "number"}, "uniqueItems": True}},
    }
    with pytest.raises(ConstraintError, match="'uniqueItems' at /properties/a/uniqueItems") as e:
        llm.extract("x", schema)
    assert isinstance(e.value, ValueError)
    assert (e.value.keyword, e.value.pointer) == ("uniqueItems", "/properties/a/uniqueItems")
    with pytest.raises(IncompleteOutputError, match="finish_reason=length") as e:
        llm.extract("Lyon is a city in France.", City, SamplingParams(temperature=0, max_tokens=3))
    assert (
        isinstance(e.value, ValueError)
        and e.value.param == "max_tokens"
        and e.value.finish_reason == "length"
    )
