"""Large structured-output specs for the tests that time grammar compilation."""

from __future__ import annotations

import json

from pdserve.engine.structured_output import MAX_SPEC_CHARS


def large_schema(salt: str = "") -> str:
    """A JSON schema just under MAX_SPEC_CHARS (~64 KB): an object of many typed,
    bounded properties, some enums and nested objects (an API's tool schema, written
    large). `salt` goes into every property name, so schemas of different salts
    compile apart (no grammar cache holds them)."""
    props, k = {}, 0
    while True:
        kind = k % 4
        props[f"field{salt}_{k}"] = (
            {"type": "integer", "minimum": 0, "maximum": k + 10} if kind == 0 else
            {"type": "string", "enum": [f"v{k}_{j}" for j in range(4)]} if kind == 1 else
            {"type": "object", "properties": {"a": {"type": "boolean"},
                                              "b": {"type": "string", "maxLength": 12}},
             "required": ["a"], "additionalProperties": False} if kind == 2 else
            {"type": "array", "items": {"type": "number"}, "maxItems": 3})
        text = json.dumps({"type": "object", "properties": props,
                           "required": list(props)[:50], "additionalProperties": False})
        if len(text) > MAX_SPEC_CHARS - 400:
            return text
        k += 1
