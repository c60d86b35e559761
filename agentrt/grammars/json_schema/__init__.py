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
  branches are provably exclusive; `required` names missing from `properties` added with the
  `additionalProperties` schema; unanchored `pattern` made a search (`.*(?:p).*`); `pattern` with
  `minLength`/`maxLength` intersected when the pattern is one repeated character class
  (`^[a-z]+$` + maxLength 3 -> `^[a-z]{1,3}$`); `format: ipv4` as an exact pattern; draft-04/07
  forms (`exclusiveMinimum: true`, `items: [...]`/`additionalItems`, `definitions`) mapped to 2020-12;
  `propertyNames`/`minProperties`/`maxProperties` dropped when the schema already implies them;
- an annotation (`title`, `description`, `default`, `examples`, unknown keywords, formats no
  validator asserts such as `int64`): ignored, as the spec says;
- unsupported: `UnsupportedSchemaError` naming the keyword and its JSON pointer, unless
  `best_effort=True`, which drops it and lists it in `NormalizedSchema.not_enforced`.

Output subset (all xgrammar enforces exactly, checked by the test suite): every subschema has one
`type` (or is `anyOf`, `enum`, `$ref` into the output's `$defs`, or `{}`); objects with
`properties`/`required`/`additionalProperties`/`minProperties`/`maxProperties` and at most one
`patternProperties` pattern on a closed object; arrays with `prefixItems`/`items`/`minItems`/
`maxItems`; strings with `minLength`/`maxLength` or `pattern` or `format`; numbers with bounds.

Modules: normalizer.py (the walk and its state), refs.py ($ref, allOf merging), combinators.py
(enum/const, anyOf/oneOf), strings.py (lengths, pattern, formats), numbers.py, arrays.py,
objects.py, keywords.py (vocabulary), values.py (JSON equality), errors.py (errors, JSON
Pointers), canonical.py (the grammar's canonical text of a value). Regex handling is in
grammars/regex.py.
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
