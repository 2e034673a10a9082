"""Metrics: one meaning per name across every process, the Grafana dashboard only uses names the
code exposes, and the node target merges every process's metrics under a `process` label."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from kvrelay import metrics
from kvrelay.metrics import NodeMetricsServer, RpcMetrics, add_process_metrics, start_metrics_server

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "monitoring" / "grafana-dashboard.json"
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created", ""),
    "info": ("_info",),
}


def process_registries() -> dict[str, CollectorRegistry]:
    """The registries each kind of process serves, built by the processes' own code."""
    from kvrelay.ar_service.service import ArMetrics
    from kvrelay.broker.compaction import JournalCompactor
    from kvrelay.broker.core import BrokerCore
    from kvrelay.broker.credential_reload import BrokerSecrets
    from kvrelay.broker.generations import GenerationStore
    from kvrelay.broker.metrics import GenerationMetrics, JournalCollector, register_broker_metrics
    from kvrelay.config import SecurityConfig
    from kvrelay.dit_service.service import DitMetrics
    from kvrelay.security import CredentialRotation, Credentials

    broker = CollectorRegistry()
    core = BrokerCore(None, journal_synchronous="OFF")
    # broker/main.py passes the servicer's RPC counts and its reloadable credentials.
    register_broker_metrics(core, broker, {}, BrokerSecrets(SecurityConfig(), CredentialRotation(Credentials())))
    GenerationMetrics(broker, lambda: 0)
    broker.register(JournalCollector(JournalCompactor(core.journal, GenerationStore(result_ttl_seconds=60, max_results=8, journal=core.journal))))
    ar = CollectorRegistry()
    ArMetrics.create(ar)
    dit = DitMetrics("dit-0").registry
    registries = {"broker": broker, "ar": ar, "dit": dit}
    for registry in registries.values():
        # What GrpcServer adds to every process's registry.
        add_process_metrics(registry)
        RpcMetrics(registry)
    core.close()
    return registries


def families(registry: CollectorRegistry) -> dict[str, tuple[str, str]]:
    """family name -> (type, help)."""
    return {m.name: (m.type, m.documentation) for m in registry.collect()}


def sample_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for metric in registry.collect():
        names.add(metric.name)
        names.update(metric.name + suffix for suffix in _SUFFIXES.get(metric.type, ()))
    return names


def node_only_names() -> set[str]:
    return {"kvrelay_node_scrape_up", "kvrelay_node_scrape_seconds"}


def dashboard_metric_names() -> set[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in doc["panels"] for t in panel.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    names: set[str] = set()
    for expr in exprs:
        without_labels = re.sub(r"\{[^}]*\}", "", expr)
        names.update(re.findall(r"\b((?:kvrelay|process|python)_[a-z0-9_]+)\b", without_labels))
    return names


def test_one_meaning_per_metric_name_across_processes() -> None:
    seen: dict[str, tuple[str, tuple[str, str]]] = {}
    for process, registry in process_registries().items():
        for name, meaning in families(registry).items():
            if name in seen:
                other, other_meaning = seen[name]
                assert meaning == other_meaning, f"{name} means {other_meaning} on {other} but {meaning} on {process}"
            seen[name] = (process, meaning)
    shared = {n for n in seen if not n.startswith(("process_", "python_", "kvrelay_grpc_server_"))}
    # Every kvrelay_* metric of a service belongs to one kind of process only (prefix or not).
    owners: dict[str, list[str]] = {}
    for process, registry in process_registries().items():
        for name in families(registry):
            if name in shared:
                owners.setdefault(name, []).append(process)
    assert {n: p for n, p in owners.items() if len(p) > 1} == {}


def test_the_dashboard_uses_only_metrics_the_code_exposes() -> None:
    exposed = set().union(*(sample_names(r) for r in process_registries().values())) | node_only_names()
    used = dashboard_metric_names()
    assert used - exposed == set(), f"the dashboard queries metrics nobody exposes: {sorted(used - exposed)}"
    # ...and it shows the RPC, process and transfer views, not only the broker's.
    assert {"kvrelay_grpc_server_handled_total", "process_cpu_seconds_total",
            "kvrelay_transfer_bytes_total", "kvrelay_dit_received_bytes_total",
            "kvrelay_ar_mooncake_engine_replacements_total"} <= used  # fmt: skip


def test_the_shipped_scrape_config_targets_the_node_port() -> None:
    import yaml

    doc = yaml.safe_load((REPO / "monitoring" / "prometheus.yml").read_text())
    targets = [t for job in doc["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["localhost:9399"]
    from kvrelay.node.cli import build_parser

    assert build_parser().parse_args(["up"]).metrics_port == 9399


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_the_node_target_carries_every_process_with_a_process_label() -> None:
    servers = []
    targets: dict[str, str] = {}
    for name, value in (("broker", 3), ("ar-0", 5)):
        registry = CollectorRegistry()
        Counter("kvrelay_example", "an example", ["kind"], registry=registry).labels("x").inc(value)
        add_process_metrics(registry)
        httpd = start_metrics_server("127.0.0.1", 0, registry)
        servers.append(httpd)
        targets[name] = f"http://127.0.0.1:{httpd.server_port}/metrics"
    targets["dit-0"] = "http://127.0.0.1:1/metrics"  # down: reported, not fatal
    node = NodeMetricsServer(lambda: targets, host="127.0.0.1", port=0).start()
    try:
        samples = _scrape(node.port)
    finally:
        node.stop()
        for httpd in servers:
            httpd.shutdown()
            httpd.server_close()
    example = {s[0]["process"]: (s[0]["kind"], s[1]) for s in samples["kvrelay_example_total"]}
    assert example == {"broker": ("x", 3.0), "ar-0": ("x", 5.0)}
    up = {labels["process"]: value for labels, value in samples["kvrelay_node_scrape_up"]}
    assert up == {"broker": 1.0, "ar-0": 1.0, "dit-0": 0.0}
    # Each process's own process metrics, the supervisor's ("up") included.
    assert {labels["process"] for labels, _ in samples["process_cpu_seconds_total"]} == {"broker", "ar-0", "up"}


@pytest.mark.parametrize("name", sorted(node_only_names()))
def test_node_only_names_are_the_node_servers(name: str) -> None:
    node = NodeMetricsServer(dict, host="127.0.0.1", port=0).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.port}/metrics", timeout=10) as reply:
            assert f"# TYPE {name} gauge" in reply.read().decode()
    finally:
        node.stop()


def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(4096) == b"":
                return True
    except TimeoutError:
        return False
    except OSError:  # reset
        return True
    return False


@pytest.mark.parametrize("which", ["process", "node"])
def test_silent_scrapers_are_bounded_and_timed_out(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found black-box: TCP connections to the broker's metrics port that never sent a request
    # each held a thread (1279 and counting) and a descriptor of the broker, for good.
    monkeypatch.setattr(metrics, "METRICS_MAX_CONNECTIONS", 4)
    monkeypatch.setattr(metrics, "METRICS_IDLE_TIMEOUT_S", 1.0)
    if which == "process":
        httpd = start_metrics_server("127.0.0.1", 0, CollectorRegistry())
        port, stop = httpd.server_port, lambda: (httpd.shutdown(), httpd.server_close())
    else:
        node = NodeMetricsServer(lambda: {}, host="127.0.0.1", port=0).start()
        port, stop = node.port, node.stop
    threads_before = threading.active_count()
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(7)]
    try:
        # Beyond the bound: closed at once, no thread started for them.
        assert all(_closed_by_peer(s, 0.5) for s in socks[4:])
        assert threading.active_count() <= threads_before + 4
        # Within it: closed once they stay silent past the idle timeout.
        assert all(_closed_by_peer(s, 5.0) for s in socks[:4])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert reply.status == 200
    finally:
        for s in socks:
            s.close()
        stop()
