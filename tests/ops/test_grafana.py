"""ops/grafana/tandem.json asks only for series the edge exports.

The exported names come from the code itself: an edge's metrics rendered with the stats
of a real broker dispatcher that has a prefill and a decode worker (so every cluster
family appears), parsed back with prometheus-client's own parser. A panel that names a
metric or a label nothing exports fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import values
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from tandem.broker.dispatcher import Dispatcher
from tandem.broker.settings import BrokerSettings
from tandem.broker.stats import snapshot
from tandem.http.metrics import EdgeMetrics
from tandem.wire import messages as M

DASHBOARD = Path(__file__).resolve().parents[2] / "ops" / "grafana" / "tandem.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
# Labels Prometheus itself adds (scrape target) or histograms carry.
SCRAPE_LABELS = {"instance", "job", "le"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "sum", "max", "min", "avg", "rate",
                "irate", "increase", "histogram_quantile", "count", "topk", "bottomk", "offset", "bool", "and", "or", "unless"}


def exported() -> dict[str, set[str]]:
    """Every series name the edge exports (with suffixes), and its label names."""
    d = Dispatcher(BrokerSettings(), to_worker=lambda *a: None, to_client=lambda *a: None, publish=lambda *a: None)
    d.worker_message(b"p", M.Ready("p", "prefill", "m", 4, None, 16, 100))
    d.worker_message(b"d", M.Ready("d", "decode", "m", 4, "tcp://127.0.0.1:9", 16, 100))
    d.counters["submitted"] += 1
    metrics = EdgeMetrics()
    for metric in vars(metrics).values():
        # A labelled series shows its labels only once it has a child.
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*["x"] * len(metric._labelnames))
    text = metrics.render(snapshot(d)).decode()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        labels = {label for s in family.samples for label in s.labels} - {"le"}
        for suffix in SUFFIXES.get(family.type, ("",)):
            names[family.name + suffix] = labels
    return names


def problems(dashboard: dict, names: dict[str, set[str]]) -> list[str]:
    out = []
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"]
            used = set(re.findall(r"\btandem_[a-z0-9_]+\b", expr))
            if not used:
                out.append(f"panel {panel['title']!r}: {expr!r} names no tandem metric")
            for name in used - names.keys():
                out.append(f"panel {panel['title']!r}: {name} is not exported")
            known = set().union(*(names.get(n, set()) for n in used)) | SCRAPE_LABELS
            selectors = [k for sel in re.findall(r"\{([^}]*)\}", expr) for k in re.findall(r"(\w+)\s*=~?", sel)]
            grouped = [w for g in re.findall(r"\bby\s*\(([^)]*)\)", expr) for w in re.findall(r"\w+", g)]
            for label in set(selectors + grouped) - known - PROMQL_WORDS:
                out.append(f"panel {panel['title']!r}: label {label!r} is on none of {sorted(used)}")
    return out


@pytest.fixture(scope="module")
def names(tmp_path_factory):
    # prometheus-client picks its value store when first imported: in-memory, or files
    # under PROMETHEUS_MULTIPROC_DIR if that was set then (a test that loaded the gunicorn
    # config sets it). Render the way this process's store is read: from memory, or from
    # a fresh directory of files.
    with pytest.MonkeyPatch.context() as mp:
        if values.ValueClass is values.MutexValue:
            mp.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
        else:
            mp.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path_factory.mktemp("metrics")))
        return exported()


def test_the_exported_names_cover_the_edge_and_the_broker(names):
    for name in ("tandem_time_to_first_token_seconds_bucket", "tandem_generation_tokens_total", "tandem_broker_up",
                 "tandem_broker_requests_queued", "tandem_broker_migrations_total", "tandem_worker_kv_blocks_used",
                 "tandem_spec_accepted_tokens_total"):
        assert name in names, name
    assert names["tandem_broker_requests_refused_total"] == {"reason"}


def test_every_panel_names_exported_metrics_and_labels(names):
    dashboard = json.loads(DASHBOARD.read_text())
    assert problems(dashboard, names) == []


def test_a_panel_naming_a_missing_metric_or_label_fails(names):
    dashboard = {"panels": [{"title": "bad", "targets": [
        {"expr": "rate(tandem_tokens_that_never_were_total[5m])"},
        {"expr": "sum by (flavour) (tandem_broker_requests_refused_total)"}]}]}
    found = problems(dashboard, names)
    assert any("tandem_tokens_that_never_were_total is not exported" in p for p in found)
    assert any("label 'flavour'" in p for p in found)


def test_the_dashboard_is_well_formed_for_import():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    (var,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert var["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${" + var["name"] + "}"
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("tokens per second", "time to first token", "inter-token latency", "queue", "kv cache", "refusals", "migrations",
                  "draft acceptance"):
        assert topic in titles, topic
