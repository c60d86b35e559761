"""The JSON Schema vocabulary the normalizer knows (draft 2020-12 with draft-04..2019-09 spellings),
by instance type, and the result marker for a subschema no value satisfies."""

from __future__ import annotations

TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
STRING_KW = ("minLength", "maxLength", "pattern", "format")
NUMBER_KW = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
ARRAY_KW = (
    "items",
    "prefixItems",
    "additionalItems",
    "minItems",
    "maxItems",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "unevaluatedItems",
)
OBJECT_KW = (
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
)
COUNT_KW = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# assertion keywords: anything else in a schema object is an annotation (ignored, as the spec says)
KNOWN = frozenset(STRING_KW + NUMBER_KW + ARRAY_KW + OBJECT_KW) | {
    "type",
    "enum",
    "const",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "$ref",
    "$dynamicRef",
    "$dynamicAnchor",
    "$recursiveRef",
    "$recursiveAnchor",
}

UNSAT = None  # a normalized subschema no value satisfies

# the backend's integer ranges are 64-bit and its length/count bounds 32-bit
INT64_MIN, INT64_MAX, INT32_MAX = -(2**63), 2**63 - 1, 2**31 - 1
