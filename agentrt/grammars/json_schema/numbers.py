"""Numbers and integers: `minimum`/`maximum`, `exclusiveMinimum`/`exclusiveMaximum`, `multipleOf`.

Integer bounds are rounded inward and clamped to 64 bits (the backend's range); a range wholly
outside 64 bits is refused. Number bounds with more than 6 decimals, or a range narrower than
1e-6, are refused (measured: the backend's decimal range grammar loses them). `multipleOf` 1
makes a number an integer; other divisors with a finite decimal expansion stay beside the bounds
and nodes.py prints the number's residue automaton (decimals.py: exact decimal arithmetic, as the
spec says), refused past that automaton's bound.
"""

from __future__ import annotations

import math

from agentrt.grammars.json_schema.errors import ptr
from agentrt.grammars.json_schema.keywords import INT64_MAX, INT64_MIN, UNSAT
from agentrt.grammars.json_schema.values import is_int, number_dfa_bounds
from agentrt.grammars.json_schema.walk import Walk


def norm_integer(n: Walk, s: dict, pointer: str):
    """The integer branch of subschema `s`."""
    return norm_number(n, s, pointer, integer=True)


def norm_number(n: Walk, s: dict, pointer: str, integer: bool = False):
    """The number (or, with integer=True, integer) branch of subschema `s`."""
    out = _integer_bounds(n, s, pointer) if integer else _number_bounds(n, s, pointer)
    if out is UNSAT or "multipleOf" not in s:
        return out
    m = s["multipleOf"]
    if is_int(m) and int(m) == 1:
        if integer:
            return out
        n.rewrite("multipleOf", ptr(pointer, "multipleOf"))
        return norm_number(n, {**s, "multipleOf": 1}, pointer, integer=True)
    return _multiple_of(n, out, m, pointer, integer)


def _multiple_of(n: Walk, out: dict, m, pointer: str, integer: bool):
    """`multipleOf` m (not 1) beside the bounds in `out`: kept for nodes.py, which prints the
    residue automaton of decimals.py; refused past its bound, UNSAT when no number is left."""
    from agentrt.grammars.json_schema.automata import AutomatonError, live_states
    from agentrt.grammars.json_schema.decimals import number_dfa

    kept = {**out, "multipleOf": int(m) if is_int(m) else m}
    try:
        dfa = number_dfa(m, **number_dfa_bounds(kept), integer=integer)
    except AutomatonError as e:
        n.unsupported("multipleOf", ptr(pointer, "multipleOf"), str(e))
        return out
    if not live_states(dfa, [bool(lab) for lab in dfa.labels])[0]:
        return UNSAT
    return kept


def _integer_bounds(n: Walk, s: dict, pointer: str):
    out = {"type": "integer"}
    lo, lo_x = s.get("minimum"), s.get("exclusiveMinimum")
    hi, hi_x = s.get("maximum"), s.get("exclusiveMaximum")
    bounds = []
    if lo is not None:
        bounds.append(math.ceil(lo))
    if lo_x is not None:
        bounds.append(math.floor(lo_x) + 1)
    if bounds:
        out["minimum"] = max(bounds)
    bounds = []
    if hi is not None:
        bounds.append(math.floor(hi))
    if hi_x is not None:
        bounds.append(math.ceil(hi_x) - 1)
    if bounds:
        out["maximum"] = min(bounds)
    if "minimum" in out and "maximum" in out and out["minimum"] > out["maximum"]:
        return UNSAT
    # the backend's integer ranges are 64-bit: a wider bound is clamped (stricter), a range
    # wholly outside is refused
    if out.get("minimum", 0) > INT64_MAX or out.get("maximum", 0) < INT64_MIN:
        kw = "minimum" if out.get("minimum", 0) > INT64_MAX else "maximum"
        n.unsupported(kw, ptr(pointer, kw), "integer bounds beyond 64 bits are not supported")
        out.pop("minimum", None)
        out.pop("maximum", None)
    if out.get("minimum", 0) < INT64_MIN:
        out["minimum"] = INT64_MIN
    if out.get("maximum", 0) > INT64_MAX:
        out["maximum"] = INT64_MAX
    return out


def _number_bounds(n: Walk, s: dict, pointer: str):
    out = {"type": "number"}
    for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if k in s:
            v = s[k]
            if not is_int(v) and abs(v - round(v, 6)) > 1e-12:
                # the backend's decimal range grammar loses such bounds (measured: a range
                # of width 1e-9 admitted an empty value)
                n.unsupported(k, ptr(pointer, k), "number bounds with more than 6 decimals are not supported")
                continue
            out[k] = int(v) if is_int(v) else v
    lo_b = max((out[k] for k in ("minimum", "exclusiveMinimum") if k in out), default=None)
    hi_b = min((out[k] for k in ("maximum", "exclusiveMaximum") if k in out), default=None)
    if lo_b is not None and hi_b is not None:
        if lo_b > hi_b or (lo_b == hi_b and ("exclusiveMinimum" in out or "exclusiveMaximum" in out)):
            return UNSAT
        if hi_b - lo_b < 1e-6 and lo_b != hi_b:
            n.unsupported("maximum", pointer, "a number range narrower than 1e-6 is not supported")
    return out
