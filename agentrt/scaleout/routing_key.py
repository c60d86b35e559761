"""The routing key of a request: the text its prompt starts with, as chunk ids.

The ingress reads a request body only this far: for the four generation routes it renders, in
prompt order, the parts that make a prompt's prefix (the `cache_salt`, then tool definitions, then
the system prompt / instructions, then the messages or prompt) into one string, without the chat
template or a tokenizer. Appending a turn to a conversation appends to this string, and two
requests whose prompts start alike have keys that start alike, which is all the router needs; it
is not the token sequence the replica computes. `cache_salt` comes first, so requests with
different salts share no prefix (the replicas' prefix caches never share KV across salts either).

The string is cut into `chunk_chars`-character chunks counted from its start (the last may be
shorter), each hashed (BLAKE2b, 64 bits) to an id: `RouteKey.chunk_ids` is what the per-replica
trees (agentrt/scaleout/radix.py) store and match. Bodies that are not JSON objects, other routes
and GET requests have no key (None): the router sends them to the least-loaded replica.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

ROUTED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
"""Routes whose body carries a prompt (the others have no routing key)."""

_SEP = "\x1e"  # record separator between the parts of the key


@dataclass(frozen=True)
class RouteKey:
    """What the router gets with a request. chunk_ids: the key's chunk ids (empty: no key);
    num_chars: the key's length in characters; target: a replica id (Serve's replica unique id)
    the request must go to when that replica is live (the ingress scraping each replica's
    /metrics), else None."""

    chunk_ids: tuple[int, ...] = ()
    num_chars: int = 0
    target: str | None = None


def _canonical(value: Any) -> str:
    """Compact JSON with sorted keys (one spelling per value, so equal parts give equal text)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def _items(value: Any) -> list[str]:
    """A list field as one canonical string per element (a string as itself, None as nothing)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v if isinstance(v, str) else _canonical(v) for v in value]
    return [_canonical(value)]


def routing_text(path: str, body: Any) -> str | None:
    """The prefix text of a request to `path` with the parsed JSON `body`, or None when the route
    carries no prompt or the body is not a JSON object. Raises nothing: a body the replica will
    refuse still gets a key (the replica answers it with its 400)."""
    if path not in ROUTED_PATHS or not isinstance(body, dict):
        return None
    salt = body.get("cache_salt")
    parts = ["salt:" + (salt if isinstance(salt, str) else "")]
    parts += ["tool:" + t for t in _items(body.get("tools"))]
    if path == "/v1/chat/completions":
        parts += ["msg:" + m for m in _items(body.get("messages"))]
    elif path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # several prompts: the batch goes where its first one is cached
        parts.append("prompt:" + (prompt if isinstance(prompt, str) else _canonical(prompt)))
    elif path == "/v1/responses":
        parts += ["system:" + s for s in _items(body.get("instructions"))]
        parts += ["msg:" + m for m in _items(body.get("input"))]
    else:  # /v1/messages
        parts += ["system:" + s for s in _items(body.get("system"))]
        parts += ["msg:" + m for m in _items(body.get("messages"))]
    return _SEP.join(parts)


def chunk_ids(text: str, chunk_chars: int) -> tuple[int, ...]:
    """`text` cut into `chunk_chars`-character chunks from its start, each hashed to a 64-bit int
    (BLAKE2b of its UTF-8 bytes, lone surrogates kept). Raises ValueError for chunk_chars < 1."""
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
    out = []
    for start in range(0, len(text), chunk_chars):
        data = text[start : start + chunk_chars].encode("utf-8", "surrogatepass")
        out.append(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little"))
    return tuple(out)


def route_key(path: str, body: Any, chunk_chars: int) -> RouteKey | None:
    """The RouteKey of a request (None when it has no routing text)."""
    text = routing_text(path, body)
    if text is None:
        return None
    return RouteKey(chunk_ids(text, chunk_chars), len(text))
