"""`agentrt serve` stops a chat template render in flight on SIGTERM and exits within its usual time
(issue 56 item 2: a looping template held the process for minutes, until SIGKILL)."""

from __future__ import annotations

import threading
import time

import httpx

from tests.api.test_template_budget import HOSTILE


def test_sigterm_stops_a_render_in_flight_and_exits(default_model_dir, tmp_path):
    """`agentrt serve` with a template that loops on one message and a 10-minute budget: SIGTERM
    while it renders exits 0 within seconds (it ignored SIGTERM for minutes: the worker thread
    rendering held the process's exit)."""
    import signal

    from agentrt.testing import agentrt_server

    path = tmp_path / "loop.jinja"
    path.write_text(HOSTILE)
    args = ("--chat-template", str(path), "--chat-template-budget", "600")
    with agentrt_server("smollm2-135m-instruct", *args, log_path=tmp_path / "server.log") as srv:
        body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "loop"}]}
        result: dict = {}

        def post():
            try:
                result["resp"] = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
            except httpx.HTTPError as e:
                result["error"] = e

        t = threading.Thread(target=post, daemon=True)
        t.start()
        time.sleep(2.0)  # the render is under way
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == 0, srv.log_tail()
        assert time.monotonic() - start < 15
        t.join(10)
        assert "resp" not in result or result["resp"].status_code == 503
