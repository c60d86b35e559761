"""A local Ray cluster for the Ray tests (extraction on Ray Data, replicas on Ray Serve)."""

from __future__ import annotations

import pytest


def start_local_ray(module: str, tries: int = 3, object_store_bytes: int = 500 << 20):
    """A local Ray cluster of 2 CPUs (no dashboard), or a skip naming why: Ray or `module` (e.g.
    "ray.data", "ray.serve") missing, or the raylet not up after `tries` starts (on a loaded 2-core
    machine its agents can miss the raylet's fixed 15 s start-up window)."""
    ray = pytest.importorskip("ray", reason='Ray is not installed: pip install "agentrt[ray]"')
    pytest.importorskip(module, reason=f'{module} is not installed: pip install "agentrt[ray]"')
    errors = []
    for _ in range(tries):
        try:
            ray.init(
                num_cpus=2,
                object_store_memory=object_store_bytes,
                include_dashboard=False,
                logging_level="WARNING",
            )
            return ray
        except Exception as e:  # noqa: BLE001 (Ray raises a bare Exception when its node times out)
            errors.append(str(e))
            ray.shutdown()
    pytest.skip(f"the local Ray cluster did not start in {tries} tries: {errors[-1]}")
