"""JSON numbers that are multiples of a decimal (`multipleOf`) within bounds, as a DFA over the
number's text (nodes.py prints it as a right-linear grammar).

The spec (JSON Schema 2020-12 validation §6.2.1): "A numeric instance is valid only if division by
this keyword's value results in an integer", on the values the JSON texts denote, which are
decimals. A divisor q with a finite decimal expansion is Q / 10^s (Q, s integers, s smallest); a
value m is a multiple of q exactly when m * 10^s is an integer divisible by Q, that is when m has at
most s significant fractional digits and the integer N = m * 10^s is 0 modulo Q. Reading the text
left to right, N mod Q is a residue automaton (each digit: r -> (10 r + d) mod Q; a text that stops
after f <= s fractional digits scales r by 10^(s - f)), and the bounds are digit-by-digit
comparisons with the bound's decimal expansion (the integer parts by length, then lexicographically),
one sign at a time (after "-", the magnitude is compared with the negated bounds).

Language: `-?(0|[1-9][0-9]*)(\\.[0-9]+)?` (no exponent; for `integer`, no fraction), every text
whose value satisfies the bounds and the divisor; fractional digits past the scale must be zeros.
Narrower than the schema on spellings only: a value written with an exponent (`1e2`) is never
produced, while every valid value has a spelling here.

Validators that divide in binary floating point disagree with the spec on some decimals: Python's
`jsonschema` with float parsing finds 0.07 not a multiple of 0.01 (0.07 / 0.01 = 7.000000000000001).
This module follows the spec (exact decimal arithmetic); `jsonschema` agrees when instance and
schema are parsed with `parse_float=decimal.Decimal`.

Bound: the automaton before minimization has at most MAX_NUMBER_STATES states (past it,
AutomatonError; the normalizer refuses `multipleOf` naming its pointer). Its size grows with Q times
the number of bound digits, e.g. multipleOf 0.01 is tiny (Q = 1), 0.0075 has Q = 75.
"""

from __future__ import annotations

import math
from fractions import Fraction

from agentrt.grammars.json_schema.automata import DFA, AutomatonError

MAX_NUMBER_STATES = 4_000
_CHARS = "-.0123456789"
_CLASSES = [[(ord(c), ord(c))] for c in _CHARS]
_DEAD = "dead"


def as_fraction(x) -> Fraction:
    """A JSON number (int, or float as the shortest decimal that reads back as it) exactly."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"not a number: {x!r}")
    return Fraction(x) if isinstance(x, int) else Fraction(repr(x))


def scale_of(q: Fraction) -> tuple[int, int]:
    """(Q, s): q = Q / 10^s with s smallest. AutomatonError when q has no finite decimal expansion."""
    s = 0
    while (q * 10**s).denominator != 1:
        s += 1
        if s > 400:
            raise AutomatonError(f"{q} has no finite decimal expansion")
    return int(q * 10**s), s


def _digits(b: Fraction) -> tuple[str, str]:
    """The decimal expansion of a bound b >= 0 with a finite one: (integer digits, fraction digits
    without trailing zeros)."""
    whole = int(b)
    frac, out = b - whole, []
    while frac:
        frac *= 10
        out.append(str(int(frac)))
        frac -= int(frac)
        if len(out) > 400:
            raise AutomatonError(f"bound {float(b)!r} has no short decimal expansion")
    return str(whole), "".join(out)


class _Cmp:
    """Comparison of a magnitude's text with bound b >= 0, digit by digit. State: ("i", j, c) after j
    integer digits whose prefix compares c (-1, 0, 1) with b's first j; ("f", k, c) in the fraction,
    c the result so far (k: fraction digits read while equal, capped at b's fraction length)."""

    def __init__(self, b: Fraction):
        self.ib, self.fb = _digits(b)

    def start(self):
        return ("i", 0, 0)

    def int_digit(self, st, d: str):
        _, j, c = st
        if j < len(self.ib) and c == 0:
            c = (d > self.ib[j]) - (d < self.ib[j])
        j = min(j + 1, len(self.ib) + 1)
        return ("i", j, 0 if j > len(self.ib) else c)  # longer than b's: c no longer matters

    def int_result(self, st) -> int:
        _, j, c = st
        return -1 if j < len(self.ib) else (1 if j > len(self.ib) else c)

    def point(self, st):
        return ("f", 0, self.int_result(st))

    def frac_digit(self, st, d: str):
        _, k, c = st
        if c != 0:
            return st  # decided (k is 0 then)
        e = self.fb[k] if k < len(self.fb) else "0"
        c = (d > e) - (d < e)
        return ("f", min(k + 1, len(self.fb)) if c == 0 else 0, c)

    def result(self, st) -> int:
        """m compared with b once the text ends in state st."""
        if st[0] == "i":
            c = self.int_result(st)
            return -1 if c == 0 and self.fb else c  # b has a nonzero fraction, m none
        _, k, c = st
        return -1 if c == 0 and k < len(self.fb) else c  # b's remaining digits are not all zero


def _sign_bounds(lo, lo_x: bool, hi, hi_x: bool, negative: bool):
    """The magnitude's bounds for one sign: ([(cmp, allowed results)], possible?). Bounds are
    Fractions or None."""
    checks = []
    if negative:  # v = -m: v >= lo <=> m <= -lo; v <= hi <=> m >= -hi
        lo, lo_x, hi, hi_x = (-hi if hi is not None else None), hi_x, (-lo if lo is not None else None), lo_x
    if hi is not None:
        if hi < 0 or (hi == 0 and hi_x):
            return [], False
        checks.append((_Cmp(hi), (-1,) if hi_x else (-1, 0)))
    if lo is not None and lo >= 0:
        checks.append((_Cmp(lo), (1,) if lo_x else (0, 1)))
    return checks, True


def number_dfa(
    q, *, minimum=None, maximum=None, exclusive_minimum=None, exclusive_maximum=None, integer=False
) -> DFA:
    """DFA over the characters `-.0123456789` (one class each, state 0 starts) of the JSON texts of
    the numbers (integers with integer=True) that are multiples of q and within the bounds (JSON
    numbers; a strict bound in exclusive_*); `labels[s]` is {0} where a text may end. Raises
    AutomatonError past MAX_NUMBER_STATES states or for a divisor without a finite decimal
    expansion."""
    qf = as_fraction(q)
    if qf <= 0:
        raise AutomatonError("multipleOf must be greater than 0")
    big_q, scale = scale_of(qf)
    signs = _signs(minimum, maximum, exclusive_minimum, exclusive_maximum)
    return _explore(_NumberStates(signs, big_q, scale, integer), f"multipleOf {q} and these bounds")


def _signs(minimum, maximum, exclusive_minimum, exclusive_maximum) -> dict:
    """{negative: the bound comparisons of that sign's magnitude} for the signs the tightest bounds
    allow (a strict bound wins a tie)."""
    lows = [(as_fraction(v), x) for v, x in ((minimum, False), (exclusive_minimum, True)) if v is not None]
    highs = [(as_fraction(v), x) for v, x in ((maximum, False), (exclusive_maximum, True)) if v is not None]
    lo, lo_x = max(lows, key=lambda t: (t[0], t[1])) if lows else (None, False)
    hi, hi_x = min(highs, key=lambda t: (t[0], not t[1])) if highs else (None, False)
    signs = {}
    for negative in (False, True):
        checks, ok = _sign_bounds(lo, lo_x, hi, hi_x, negative)
        if ok:
            signs[negative] = checks
    return signs


class _NumberStates:
    """The states of the number automaton and their moves. A state: (phase, sign, comparison states,
    residue mod Q, fraction digits read capped at scale + 1); phase: "s" start, "m" after "-", "z"
    integer part "0", "i" integer digits, "p" after ".", "f" fraction digits."""

    start = ("s", False, (), 0, 0)

    def __init__(self, signs: dict, big_q: int, scale: int, integer: bool):
        self.signs, self.big_q, self.scale, self.integer = signs, big_q, scale, integer

    def step(self, st, ch: str):
        """The state after character ch, or _DEAD."""
        signs, big_q, scale = self.signs, self.big_q, self.scale
        phase, neg, cmps, r, f = st
        checks = signs.get(neg)
        if phase == "s" and ch == "-":
            return ("m", True, tuple(c.start() for c, _ in signs[True]), 0, 0) if True in signs else _DEAD
        if phase == "s":
            if False not in signs:
                return _DEAD
            checks = signs[False]
            cmps = tuple(c.start() for c, _ in checks)
            phase = "m"
        if ch.isdigit() and phase in ("m", "i"):
            if phase == "m" and ch == "0":
                nxt = "z"
            else:
                nxt = "i"
            return (
                nxt,
                neg,
                tuple(c.int_digit(x, ch) for (c, _), x in zip(checks, cmps)),
                (10 * r + int(ch)) % big_q,
                0,
            )
        if ch == "." and phase in ("z", "i") and not self.integer:
            return ("p", neg, tuple(c.point(x) for (c, _), x in zip(checks, cmps)), r, 0)
        if ch.isdigit() and phase in ("p", "f"):
            if f >= scale:
                if ch != "0":
                    return _DEAD  # m * 10^s would not be an integer
                r2, f2 = r, scale + 1
            else:
                r2, f2 = (10 * r + int(ch)) % big_q, f + 1
            return ("f", neg, tuple(c.frac_digit(x, ch) for (c, _), x in zip(checks, cmps)), r2, f2)
        return _DEAD

    def accepting(self, st) -> bool:
        """Whether a text may end in st: a whole number read, a multiple of q, within the bounds."""
        phase, neg, cmps, r, f = st
        if phase not in ("z", "i", "f"):
            return False
        used = min(f, self.scale)
        if (r * 10 ** (self.scale - used)) % self.big_q:
            return False
        return all(c.result(x) in allowed for (c, allowed), x in zip(self.signs[neg], cmps))


def _explore(states: _NumberStates, what: str) -> DFA:
    """The DFA of the states reachable from states.start (breadth first; state 0 starts, 1 is dead).
    Raises AutomatonError naming `what` past MAX_NUMBER_STATES states."""
    start = states.start
    index = {start: 0, _DEAD: 1}
    order = [start, _DEAD]
    trans: list[list[int]] = []
    i = 0
    while i < len(order):
        st = order[i]
        i += 1
        row = []
        for ch in _CHARS:
            t = _DEAD if st == _DEAD else states.step(st, ch)
            j = index.get(t)
            if j is None:
                if len(order) >= MAX_NUMBER_STATES:
                    raise AutomatonError(
                        f"the number automaton for {what} would exceed {MAX_NUMBER_STATES} states"
                    )
                j = index[t] = len(order)
                order.append(t)
            row.append(j)
        trans.append(row)
    labels = [frozenset({0}) if st != _DEAD and states.accepting(st) else frozenset() for st in order]
    return DFA([list(c) for c in _CLASSES], trans, labels)


def multiple_lcm(a, b):
    """The least common multiple of two positive JSON numbers with finite decimal expansions (the
    multiples of both), as an int or a float that reads back as it exactly; None when no float
    holds it exactly."""
    fa, fb = as_fraction(a), as_fraction(b)
    out = Fraction(math.lcm(fa.numerator, fb.numerator), math.gcd(fa.denominator, fb.denominator))
    if out.denominator == 1:
        return int(out)
    f = float(out)
    return f if Fraction(repr(f)) == out else None
