"""Judging one output: parse it and validate it against the user's schema (jsonschema, formats on)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from jsonschema.validators import validator_for


class SchemaValidators:
    """jsonschema validators with format checking (`jsonschema.FormatChecker()`), one per schema
    (cached by the schema's JSON text)."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def get(self, schema: dict) -> Any:
        key = json.dumps(schema, sort_keys=True)
        v = self._cache.get(key)
        if v is None:
            cls = validator_for(schema, default=jsonschema.Draft202012Validator)
            v = self._cache[key] = cls(schema, format_checker=jsonschema.FormatChecker())
        return v


def judge(
    text: str, finish_reason: str | None, validator: Any, num_tokens: int
) -> tuple[Any, bool, str | None, str | None]:
    """(output, valid, error, failure) of an output `text` that ended with `finish_reason` after
    `num_tokens` tokens. "length" is never valid (the JSON was cut off); a "stop" output is valid
    when it parses and `validator` finds no error (the first error, with its JSON pointer, is the
    reason otherwise)."""
    if finish_reason == "length":
        return (
            None,
            False,
            f"the output ran out of tokens (max_tokens, {num_tokens} tokens) before the JSON was complete",
            "length",
        )
    if finish_reason != "stop":
        return (
            None,
            False,
            f"the request ended with finish_reason {finish_reason!r}",
            finish_reason or "error",
        )
    try:
        output = json.loads(text)
    except json.JSONDecodeError as e:
        return None, False, f"the output is not JSON: {e}", "invalid"
    err = jsonschema.exceptions.best_match(validator.iter_errors(output))
    if err is not None:
        where = "/" + "/".join(str(p) for p in err.absolute_path)
        return output, False, f"the output does not satisfy the schema: at {where}: {err.message}", "invalid"
    return output, True, None, None
