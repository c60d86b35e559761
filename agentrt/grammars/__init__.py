"""Constraint specs -> compiled grammars (xgrammar adapter), per-request matchers, token bitmasks."""

from agentrt.grammars.spec import ConstraintSpec, GrammarConfig

__all__ = ["ConstraintSpec", "GrammarConfig"]
