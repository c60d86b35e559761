"""/metrics of a replicated deployment: every replica's own metrics, each sample labelled with
`replica` (Serve's replica id), plus whether each replica answered the scrape.

Parsed and written back with prometheus-client (its text parser and exposition writer), so the
families keep their types and help texts and each family appears once with all replicas' samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    """A collector of fixed metric families (a registry needs a collector)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_replica_metrics(texts: Mapping[str, str | None], label: str = "replica") -> bytes:
    """The Prometheus text of every replica's metrics (`texts`: replica id -> its /metrics text,
    None when it did not answer), each sample with the extra label `label`="<replica id>", and
    the gauge `agentrt_replica_up` (1 answered, 0 not) per replica. Raises ValueError when a text
    is not in the text exposition format."""
    families: dict[str, Metric] = {}
    up = GaugeMetricFamily("agentrt_replica_up", "Whether the replica answered this scrape", labels=[label])
    for rid, text in texts.items():
        up.add_metric([rid], 0.0 if text is None else 1.0)
        if text is None:
            continue
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                merged.add_sample(s.name, {**s.labels, label: rid}, s.value, s.timestamp, s.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([up, *families.values()]))
    return generate_latest(registry)
