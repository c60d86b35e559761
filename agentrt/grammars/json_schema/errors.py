"""Errors of the faithful-schema pass, and the JSON Pointers (RFC 6901) that say where they are.

Every refusal names the keyword and the pointer of the subschema that holds it, so the API can
return them as fields (`keyword`, `pointer`) and in the message text.
"""

from __future__ import annotations


class UnsupportedSchemaError(ValueError):
    """A keyword the runtime cannot enforce. `keyword` and `pointer` (RFC 6901) name it."""

    def __init__(self, keyword: str, pointer: str, reason: str):
        self.keyword, self.pointer, self.reason = keyword, pointer or "/", reason
        super().__init__(f"JSON Schema keyword '{keyword}' at {pointer or '/'} cannot be enforced: {reason}")


class UnsatisfiableSchemaError(ValueError):
    """The schema (or the subschema at `pointer`) admits no instance."""

    def __init__(self, pointer: str, reason: str):
        super().__init__(f"JSON Schema at {pointer or '/'} admits no value: {reason}")


def ptr(base: str, *parts) -> str:
    """JSON Pointer `base` extended by reference tokens `parts` (RFC 6901 §3: `~` -> `~0`,
    `/` -> `~1`). The root is "" (shown as "/" in messages)."""
    return base + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)
