"""Faithful JSON Schema: rewrite a user's schema into the subset the grammar backend enforces
exactly, and refuse (or, best-effort, report) every keyword it would silently drop.

Why: xgrammar compiles any schema, but ignores keywords it does not implement (`not`, `if`,
`contains`, `uniqueItems`, `multipleOf`, `maxLength` beside `pattern` or `format`, type-specific
keywords on an untyped schema, `$ref` siblings, ...), so "constrained" output can violate the
schema. Measured on the JSON-Schema-Test-Suite (draft 2020-12): raw xgrammar accepts 300+ invalid
instances; after this pass none (tests/grammars/test_json_schema.py).

The pass walks the schema once (`normalize_schema`). Each keyword is
- enforced by the grammar: emitted unchanged in the subset below;
- enforced by a rewrite: untyped keywords split per type (`{"maxLength": 2}` becomes
  "a string of at most 2 characters, or any non-string"); `allOf` merged into one schema;
  `$ref` siblings merged with the target; `enum`/`const` filtered by the whole subschema with
  `jsonschema` (so every other keyword beside an enum holds); `oneOf` turned into `anyOf` when its
  branches are provably exclusive, else into "branch i and not each overlapping branch j" when those
  have complements (negation.py); `required` names missing from `properties` added with the
  `additionalProperties` schema; unanchored `pattern` made a search (`.*(?:p).*`); `pattern` with
  `minLength`/`maxLength` intersected when the pattern is one repeated character class
  (`^[a-z]+$` + maxLength 3 -> `^[a-z]{1,3}$`); `format: ipv4` as an exact pattern; draft-04/07
  forms (`exclusiveMinimum: true`, `items: [...]`/`additionalItems`, `definitions`) mapped to 2020-12;
  `propertyNames`/`minProperties`/`maxProperties` dropped when the schema already implies them;
  `dependentRequired`/`dependentSchemas` as one anyOf branch per choice of present trigger names;
  `not` as its positive complement (negation.py: type, required, properties, items, contains, scalar
  enum/const, bounds, pattern, anyOf/allOf/not of those); a `pattern` beside a format that has a
  pattern (or email) as one product automaton; `if`/`then`/`else` as alternatives
  (conditionals.py); `contains` with the items schema merged in; under drafts 4 to 7, keywords
  beside `$ref` dropped (those drafts ignore them);
- an annotation (`title`, `description`, `default`, `examples`, unknown keywords, formats no
  validator asserts such as `int64`): ignored, as the spec says;
- unsupported: `UnsupportedSchemaError` naming the keyword and its JSON pointer, unless
  `best_effort=True`, which drops it and lists it in `NormalizedSchema.not_enforced`.

Output subset (all enforced exactly, checked by the test suite): every subschema has one `type`
(or is `anyOf`, `enum`, `$ref` into the output's `$defs`, or `{}`); objects with `properties`
(a `false` one: forbidden), `required`, `additionalProperties`, `patternProperties`,
`propertyNames` (a string pattern, length range or enum), `minProperties` (at most 1 on an object
that admits other keys) and `maxProperties`; arrays with `prefixItems`/`items`/`minItems`/
`maxItems`, `uniqueItems` (items of a few scalars) or `contains`/`minContains` (the items schema
merged in); strings with `minLength`/`maxLength`, `pattern` (with or without a length range) or
`format`; numbers with bounds and `multipleOf`. xgrammar's converter enforces most of it; objects
it gets wrong (patterns, names, forbidden keys, counts on open objects), patterns with a length
range, `format: regex`, multiples, unique items and `contains` get grammars of our own (nodes.py
over automata.py and decimals.py), spliced into its output.

Per keyword (docs: README "Constraints"):
- enforced: type, enum, const, properties, required, additionalProperties, patternProperties
  (overlapping patterns need equal schemas), propertyNames (string pattern / length / enum),
  dependentRequired and dependentSchemas (at most 4 trigger names: 2^4 anyOf branches), allOf,
  anyOf, $ref (local), prefixItems, items, minItems, maxItems, minLength, maxLength, pattern,
  minimum/maximum (and exclusive), unevaluatedProperties without in-place applicators, format
  (date, time, date-time, ipv4, hostname, email, uri, uuid, ...);
- enforced with limits: oneOf (branches provably exclusive, decided by whole types, or rewritten
  with the complements of overlapping branches, at most 64 alternatives per branch; closed-object
  branches complemented within their names), not (of the forms negation.py complements),
  multipleOf (exact decimal residue automaton, decimals.py: at most 4000 states, no exponents),
  uniqueItems (items of at most 1024 sets of scalar values; over free strings checked by the
  matcher at string completion, grammars/unique_items.py), contains/minContains (counting
  grammar of at most 256 rules, not beside prefixItems), if/then/else (an `if` with a complement,
  at most 3 together, or any number testing one property's value), format regex (a subset ECMA-262
  and Python both compile: narrower),
  minProperties (> 1 only on closed objects), maxProperties (a repeated key counts twice: stricter),
  pattern + length (product automaton of at most 4000 states), strings under maxLength take no
  escapes, keys matched by patterns or names use no escapes, quote, backslash or control
  characters (stricter), objects of our own grammar are refused with `indent` set;
- refused: uniqueItems over numbers, objects or constrained strings (and over free strings in tool
  arguments or in ambiguous places, unique_items.unique_plan), maxContains below the length
  bound, if without a complement, not of other schemas (additionalProperties, patternProperties,
  format, uniqueItems, integers alone), multipleOf past its automaton bound, unevaluatedItems,
  unevaluatedProperties beside applicators, remote/anchor $ref, $dynamicRef, custom metaschemas
  ($schema), lookaround and backreferences in patterns, case-insensitive key patterns.

Modules: normalizer.py (the walk and its state), refs.py ($ref, allOf merging), combinators.py
(enum/const, anyOf/oneOf), negation.py (complements for not/oneOf), conditionals.py (if/then/else),
strings.py (lengths, pattern, formats), numbers.py, decimals.py (multipleOf automaton), arrays.py,
objects.py, automata.py (regex -> DFA, products, complements), nodes.py (our EBNF for objects and
strings xgrammar does not enforce exactly), keywords.py (vocabulary), values.py (JSON equality),
errors.py (errors, JSON Pointers), canonical.py (the grammar's canonical text of a value). Regex
handling is in grammars/regex.py.
"""

from agentrt.grammars.json_schema.canonical import canonical_json
from agentrt.grammars.json_schema.errors import UnsatisfiableSchemaError, UnsupportedSchemaError
from agentrt.grammars.json_schema.normalizer import NormalizedSchema, normalize_schema
from agentrt.grammars.json_schema.strings import FORMAT_PATTERNS, GRAMMAR_FORMATS
from agentrt.grammars.json_schema.values import value_to_schema

__all__ = [
    "FORMAT_PATTERNS",
    "GRAMMAR_FORMATS",
    "NormalizedSchema",
    "UnsatisfiableSchemaError",
    "UnsupportedSchemaError",
    "canonical_json",
    "normalize_schema",
    "value_to_schema",
]
