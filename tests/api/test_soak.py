"""Soak (slow): 64 concurrent clients, mostly streaming, with random disconnects and mixed constraints
(plain, json_schema, regex, fresh regexes that churn the compiler and its cache, choice, tools)
against a real server in a child process (bench/soak.py: the fake model runner by default).

After the load: no error other than the clients' own aborts, the server's RSS grew less than 5%
between the end of the warm-up and the end, and once every request settled /metrics shows no KV
held for requests and nothing running or waiting; a request after that is served normally.

    AGENTRT_SOAK_S=45 make test-slow ARGS=tests/api/test_soak.py     # a quick run (default 600 s)
    AGENTRT_SOAK_MODEL=smollm2-135m-instruct ...                     # `agentrt serve` on a model
"""

from __future__ import annotations

import os

import httpx
import pytest

from bench.soak import FAKE_MODEL, default_warmup_s, run_soak, soak_server

DURATION_S = float(os.environ.get("AGENTRT_SOAK_S", "600"))
MODEL = os.environ.get("AGENTRT_SOAK_MODEL", FAKE_MODEL)
MAX_RSS_GROWTH = 0.05


@pytest.mark.slow
def test_soak_random_disconnects_mixed_constraints(tmp_path):
    with soak_server(MODEL, log_path=tmp_path / "server.log") as (url, pid):
        res = run_soak(
            url,
            pid,
            duration_s=DURATION_S,
            warmup_s=default_warmup_s(DURATION_S),
            concurrency=64,
            model=MODEL,
        )
        print(res.report())
        after = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=120,
        )
    assert res.errors == [], res.report()
    assert res.num_completed > 0 and res.num_aborted > 0, res.report()
    assert res.settled_gauges is not None, f"requests never settled:\n{res.report()}"
    g = res.settled_gauges
    assert g["agentrt_kv_usage_ratio"] == 0, res.report()
    assert g["agentrt_num_requests_running"] == 0 and g["agentrt_num_requests_waiting"] == 0, res.report()
    assert res.rss_growth_after_warmup < MAX_RSS_GROWTH, res.report()
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"], after.text
