"""What a keyword family (refs.py, combinators.py, conditionals.py, strings.py, numbers.py, arrays.py,
objects.py) sees of the normalizer's walk: the `Walk` protocol, which normalizer.Normalizer
implements. The families are typed against it, so none of them imports the normalizer, which
imports them all."""

from __future__ import annotations

from typing import Any, Protocol


class Walk(Protocol):
    """The state of one `normalize_schema` walk and the calls a keyword family makes on it.

    root: the input schema (what `$ref`s resolve against); close_objects / unique_strings: the
    options (normalize_schema's); validator: the jsonschema validator of the root's draft, formats
    asserted; defs: output `$defs` by name ("d0", ...); def_names: input fragment -> output `$defs`
    name; in_progress: fragments being normalized; inlining: fragments being inlined (refs.inline);
    recursive_inlines: inlines so far of a fragment being normalized (bounded)."""

    root: Any
    close_objects: bool
    unique_strings: bool
    validator: Any
    defs: dict[str, Any]
    def_names: dict[str, str]
    in_progress: set[str]
    inlining: set[str]
    recursive_inlines: int

    def norm(self, s: Any, pointer: str) -> Any:
        """The normalized subschema `s` (at JSON pointer `pointer`), or keywords.UNSAT."""
        ...

    def negated(self, sub: Any, pointer: str) -> Any:
        """The complement of raw subschema `sub` (negation.negation, `$ref`s and `allOf`s inlined
        first), or None when there is none here."""
        ...

    def unsupported(self, keyword: str, pointer: str, reason: str) -> None:
        """Raise UnsupportedSchemaError, or under best effort record "keyword at pointer"."""
        ...

    def rewrite(self, keyword: str, pointer: str) -> None:
        """Record that `keyword` at `pointer` is enforced by a rewrite rather than as written."""
        ...

    def count_bounds(self, min_kw: str, lo: Any, hi: Any, pointer: str) -> tuple[Any, Any]:
        """(lo, hi) of a length/count range, a minimum past the backend's 32-bit counters refused
        (unsupported) and a maximum that large dropped (None)."""
        ...

    def upgrade(self, s: dict, pointer: str) -> dict:
        """Draft-04/06/07 spellings of `s` -> 2020-12, in place; returns `s`."""
        ...
