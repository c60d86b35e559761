"""Errors of the faithful-schema pass, and the JSON Pointers (RFC 6901) that say where they are.

Both errors are `agentrt.errors.ConstraintError`s (so also ValueErrors) carrying `keyword` and
`pointer` as fields: the API reads them there, never from the message text. `param` is left None
(the API layer knows which request field held the schema).
"""

from __future__ import annotations

from agentrt.errors import ConstraintError


class UnsupportedSchemaError(ConstraintError):
    """A keyword the runtime cannot enforce. `keyword` and `pointer` (RFC 6901; "/" for the root)
    name it; `reason` says why."""

    def __init__(self, keyword: str, pointer: str, reason: str):
        super().__init__(
            f"JSON Schema keyword '{keyword}' at {pointer or '/'} cannot be enforced: {reason}",
            keyword=keyword,
            pointer=pointer or "/",
        )
        self.reason = reason

    def __reduce__(self):  # picklable despite the three-argument constructor
        return type(self), (self.keyword, self.pointer, self.reason), self.__dict__


class UnsatisfiableSchemaError(ConstraintError):
    """The schema (or the subschema at `pointer`, "/" for the root) admits no instance; `keyword`
    is None (no single keyword is at fault)."""

    def __init__(self, pointer: str, reason: str):
        super().__init__(f"JSON Schema at {pointer or '/'} admits no value: {reason}", pointer=pointer or "/")
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.pointer, self.reason), self.__dict__


def ptr(base: str, *parts) -> str:
    """JSON Pointer `base` extended by reference tokens `parts` (RFC 6901 §3: `~` -> `~0`,
    `/` -> `~1`). The root is "" (shown as "/" in messages)."""
    return base + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)
