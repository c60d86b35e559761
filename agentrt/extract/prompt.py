"""Prompting for JSON extraction jobs: the instruction that pairs a document with its schema.

The default prompt is a system message (SYSTEM_PROMPT with the schema's JSON text) followed by a
user message holding the document text as is. Putting the system prompt + schema first makes it a
prefix shared by every document with that schema, which the prefix cache computes once.

A custom template (`agentrt extract --prompt FILE`) is text with the placeholders `{text}` (the
document, required) and `{schema}` (the schema's JSON text, optional), replaced literally (other
braces, e.g. JSON examples, are left alone). A line holding only `---` splits it into a system
message (above) and a user message (below); without one the whole template is the user message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SYSTEM_PROMPT = (
    "You extract information from documents. Reply with one JSON object that follows this JSON "
    "Schema, using only facts stated in the document:\n{schema}"
)

Messages = list[dict[str, str]]


def extraction_messages(text: str, schema: dict) -> Messages:
    """Chat messages asking the model to extract `schema`'s fields from `text` (the default prompt)."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(schema=json.dumps(schema, ensure_ascii=False))},
        {"role": "user", "content": text},
    ]


@dataclass(frozen=True)
class PromptTemplate:
    """A custom extraction prompt (see the module docstring). system: the system message template or
    None; user: the user message template."""

    system: str | None
    user: str

    @classmethod
    def parse(cls, template: str) -> PromptTemplate:
        """Split a template on its first line that is exactly `---`. Raises ValueError when `{text}`
        appears nowhere (the document would be left out of the prompt)."""
        if "{text}" not in template:
            raise ValueError("the prompt template has no {text} placeholder: the document would be left out")
        lines = template.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.strip("\r\n") == "---":
                system, user = "".join(lines[:i]).rstrip("\n"), "".join(lines[i + 1 :]).strip("\n")
                return cls(system or None, user)
        return cls(None, template.strip("\n"))

    @classmethod
    def load(cls, path: str | Path) -> PromptTemplate:
        """Read and parse a template file (UTF-8). Raises OSError when it cannot be read, ValueError
        as `parse`."""
        return cls.parse(Path(path).read_text(encoding="utf-8"))

    def messages(self, text: str, schema: dict) -> Messages:
        """The chat messages for one document."""
        schema_text = json.dumps(schema, ensure_ascii=False)

        def fill(t: str) -> str:  # one pass, so a document containing "{schema}" stays as it is
            parts = t.split("{text}")
            return text.join(p.replace("{schema}", schema_text) for p in parts)

        msgs = [{"role": "system", "content": fill(self.system)}] if self.system is not None else []
        return [*msgs, {"role": "user", "content": fill(self.user)}]


def prompt_messages(text: str, schema: dict, template: PromptTemplate | None = None) -> Messages:
    """The messages for one document: the default prompt, or `template`'s."""
    return extraction_messages(text, schema) if template is None else template.messages(text, schema)
