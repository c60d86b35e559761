"""The type family (*kind*) of a column's SQL type, as each source spells the type: type text
(a JSON schema's, read with sqlglot: `kind_of_type`), a sqlglot DataType (CREATE TABLE text:
`kind_of_datatype`) and a SQLAlchemy type (a reflected database: `kind_of_sqlalchemy_type`).
The kinds and what they decide are described in agentrt.sql.schema (`TypeKind`)."""

from __future__ import annotations

import functools
import re

from agentrt.sql.schema import TypeKind

_TYPE_SHAPE = re.compile(r"[A-Za-z_][A-Za-z0-9_ .]*(\(\s*\d+\s*(,\s*\d+\s*)?\))?[A-Za-z0-9_ ]*(\[\d*\])*")
_TYPE_ARGS = re.compile(r"\(\s*\d+\s*(,\s*\d+\s*)?\)")


def kind_of_type(type_text: str, dialect: str = "sqlite") -> TypeKind:
    """The kind of an SQL type written as text (parsed with sqlglot in `dialect`); "other" for
    an empty or unknown type, and for text not shaped like a type name (words, an optional
    `(n)` / `(p, s)`, array brackets), which is never given to sqlglot: a JSON schema's types are
    10,000 parses at most, each of a short name. The kind does not depend on the numbers in
    parentheses, so it is computed once per (name without them, dialect)."""
    if not type_text or not type_text.strip() or not _TYPE_SHAPE.fullmatch(type_text.strip()):
        return "other"
    return _kind_of_type_name(" ".join(_TYPE_ARGS.sub(" ", type_text).lower().split()), dialect)


@functools.lru_cache(maxsize=1024)
def _kind_of_type_name(type_text: str, dialect: str) -> TypeKind:
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    try:
        dt = exp.DataType.build(type_text, dialect=dialect, udt=True)
    except (SqlglotError, ValueError, TypeError):
        return "other"
    return kind_of_datatype(dt)


def kind_of_datatype(dt) -> TypeKind:
    """The kind of a sqlglot exp.DataType."""
    from sqlglot import exp

    T = exp.DataType.Type
    t = dt.this
    if t == T.BOOLEAN:
        return "bool"
    if t in (T.MONEY, T.SMALLMONEY, T.BIT):  # PostgreSQL: money and bit strings are not numbers
        return "other"
    if t in exp.DataType.INTEGER_TYPES or t in exp.DataType.REAL_TYPES:
        return "num"
    if t in exp.DataType.TEXT_TYPES:
        return "text"
    if t in (
        T.DATE,
        T.DATE32,
        T.DATETIME,
        T.DATETIME64,
        T.TIMESTAMP,
        T.TIMESTAMPTZ,
        T.TIMESTAMPLTZ,
        T.TIMESTAMPNTZ,
        T.TIMESTAMP_S,
        T.TIMESTAMP_MS,
        T.TIMESTAMP_NS,
    ):
        return "date"
    return "other"


def kind_of_sqlalchemy_type(t) -> TypeKind:
    """The kind of a SQLAlchemy type object (as the inspector reflects it)."""
    from sqlalchemy import types as st

    if isinstance(t, st.Boolean):
        return "bool"
    if isinstance(t, (st.Integer, st.Numeric)):
        return "num"
    if isinstance(t, st.Enum):
        return "other"
    if isinstance(t, st.String):
        return "text"
    if isinstance(t, (st.DateTime, st.Date)):
        return "date"
    return "other"
