"""Constraint specs -> compiled grammars (xgrammar adapter), per-request matchers, token bitmasks.

Modules:
- spec.py: ConstraintSpec (what a request asks for, validated) and GrammarConfig.
- xgrammar_backend.py: the one adapter to xgrammar: compile (cached, off the engine loop, time
  limit), matchers, bitmask fill and xgrammar's apply kernel.
- pipeline.py: one constraint's compile, spec -> grammar -> finite check -> compiled grammar
  (schema EBNF post-processing included); compile_child.py runs it in killable child processes.
- json_schema/: the faithful-schema pass (normalize to what the grammar enforces exactly, refuse
  the rest naming keyword and JSON pointer) and the canonical text of a value.
- regex.py: all regex handling: ECMA search -> whole match, length intersection, regex -> EBNF.
- lark_grammar.py: Lark grammars -> EBNF (why not xgrammar's from_lark: its docstring).
- tool_calls.py: tool-call formats and their structural tag.
- finite.py: refuse grammars with no finite output.
- jump_forward.py: token ids of grammar-forced text.
- length_policy.py: closing paths so a constrained output can finish within max_tokens.
- conformance.py: whole-text matcher checks and JSON Schema instance counts (tests, bench).
Errors raised here are agentrt.errors.ConstraintError (keyword / pointer / tool_index as fields).
"""

from agentrt.grammars.spec import ConstraintSpec, GrammarConfig

__all__ = ["ConstraintSpec", "GrammarConfig"]
