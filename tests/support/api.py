"""Requests to the OpenAI API as the API tests make them."""

from __future__ import annotations

import json


def sse_chunks(client, body: dict, url: str = "/v1/chat/completions"):
    """POST a streaming request with `client` (TestClient/httpx) and yield each parsed SSE chunk
    (not [DONE]); asserts a 200 and no error event."""
    with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            yield chunk
