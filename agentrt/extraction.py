"""Prompting for JSON extraction jobs: the instruction that pairs a document with its schema."""

from __future__ import annotations

import json

SYSTEM_PROMPT = (
    "You extract information from documents. Reply with one JSON object that follows this JSON "
    "Schema, using only facts stated in the document:\n{schema}"
)


def extraction_messages(text: str, schema: dict) -> list[dict[str, str]]:
    """Chat messages asking the model to extract `schema`'s fields from `text`."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(schema=json.dumps(schema, ensure_ascii=False))},
        {"role": "user", "content": text},
    ]
