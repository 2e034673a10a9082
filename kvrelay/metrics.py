"""Metrics every kvrelay process shares, and the node's one scrape target.

Owns three things: the process metrics (`process_*`, `python_*`) on a process's own registry; the
per-RPC metrics of its gRPC server (a server interceptor); and `NodeMetricsServer`, which `kvrelay
up` runs so that one scrape of the node returns every child's metrics with a `process` label
(`broker`, `ar-0`, `dit-1`...). Metric names are listed in docs/operations.md; the Grafana
dashboard in monitoring/ is checked against them by tests/foundation/test_metrics.py.

It never imports a service package or torch; the node server only speaks HTTP to its children.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.logging import get_logger, wrap_handler

log = get_logger(__name__)

RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def add_process_metrics(registry: CollectorRegistry) -> None:
    """process_* (CPU, memory, fds, start time), python_gc_* and python_info on `registry`
    (prometheus_client puts them only on its global registry, which our processes do not serve)."""
    from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, REGISTRY

    if registry is REGISTRY:
        return
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        try:
            registry.register(collector)
        except ValueError:
            pass  # already there


_RPC_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, RpcMetrics] = weakref.WeakKeyDictionary()


def rpc_metrics_for(registry: CollectorRegistry) -> RpcMetrics:
    """The RpcMetrics of `registry` (one per registry: several servers may share one)."""
    metrics = _RPC_METRICS.get(registry)
    if metrics is None:
        metrics = _RPC_METRICS[registry] = RpcMetrics(registry)
    return metrics


class RpcMetrics:
    """kvrelay_grpc_server_started_total, _handled_total{grpc_code} and _handling_seconds, by
    service and method, for every call a server handles (health and reflection included)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_service", "grpc_method"]
        self.started = Counter(
            "kvrelay_grpc_server_started", "RPCs started on this server", labels, registry=registry
        )
        self.handled = Counter(
            "kvrelay_grpc_server_handled",
            "RPCs completed on this server, by status code",
            [*labels, "grpc_code"],
            registry=registry,
        )
        self.seconds = Histogram(
            "kvrelay_grpc_server_handling_seconds",
            "Time from the call reaching its handler to its end (a stream: until it closes)",
            labels,
            buckets=RPC_BUCKETS,
            registry=registry,
        )

    def interceptor(self) -> Any:
        import grpc

        observe = self._observe

        class _RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
            async def intercept_service(self, continuation: Any, details: Any) -> Any:
                handler = await continuation(details)
                if handler is None:
                    return None
                return wrap_handler(handler, details.method, observe)

        return _RpcMetricsInterceptor()

    @asynccontextmanager
    async def _observe(self, method: str, request: Any, context: Any) -> AsyncIterator[None]:
        import grpc

        service, _, name = method.lstrip("/").rpartition("/")
        self.started.labels(service, name).inc()
        start = time.perf_counter()
        code = "OK"
        try:
            yield
            code = _code_name(context.code()) or "OK"
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except grpc.aio.AbortError:
            code = _code_name(context.code()) or "UNKNOWN"
            raise
        except Exception:
            code = _code_name(context.code()) or "UNKNOWN"
            raise
        finally:
            self.seconds.labels(service, name).observe(time.perf_counter() - start)
            self.handled.labels(service, name, code).inc()


def _code_name(code: Any) -> str | None:
    if code is None:
        return None
    name = getattr(code, "name", None)
    if isinstance(name, str):
        return name
    import grpc

    for member in grpc.StatusCode:
        if member.value[0] == code:
            return member.name
    return None


# ----------------------------------------------------------------------------- the node target


class _ChildMetrics:
    """A collector that scrapes every child at collect() time and labels its samples."""

    def __init__(
        self, targets: Callable[[], Mapping[str, str]], timeout_s: float, local: Mapping[str, CollectorRegistry]
    ) -> None:
        self._targets = targets
        self._timeout_s = timeout_s
        self._local = dict(local)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvrelay-node-scrape")

    def _fetch(self, url: str) -> str:
        with urllib.request.urlopen(url, timeout=self._timeout_s) as reply:  # noqa: S310 - our own children
            return str(reply.read().decode("utf-8", errors="replace"))

    def collect(self) -> Iterable[Metric]:
        targets = dict(self._targets())
        futures = {name: self._pool.submit(self._fetch, url) for name, url in targets.items()}
        up = GaugeMetricFamily(
            "kvrelay_node_scrape_up", "1 when the node could read this process's metrics", labels=["process"]
        )
        seconds = GaugeMetricFamily(
            "kvrelay_node_scrape_seconds", "Time to read this process's metrics", labels=["process"]
        )
        merged: dict[str, Metric] = {}
        texts: list[tuple[str, str]] = [(name, generate_latest(r).decode()) for name, r in self._local.items()]
        for name, future in futures.items():
            start = time.perf_counter()
            try:
                texts.append((name, future.result(timeout=self._timeout_s + 1)))
            except Exception as err:  # noqa: BLE001 - a child down or restarting: up=0, the rest served
                up.add_metric([name], 0)
                log.debug("node_scrape_failed", process=name, error=str(err))
                continue
            up.add_metric([name], 1)
            seconds.add_metric([name], time.perf_counter() - start)
        for name, text in texts:
            for family in text_string_to_metric_families(text):
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                elif target.type != family.type:
                    continue  # the same name meaning two things: never the case in kvrelay (tested)
                for sample in family.samples:
                    target.add_sample(
                        sample.name, {"process": name, **sample.labels}, sample.value, sample.timestamp, sample.exemplar
                    )
        yield up
        yield seconds
        yield from merged.values()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class NodeMetricsServer:
    """`http://HOST:PORT/metrics`: every child's metrics (label `process`), scraped on request,
    plus the supervisor's own process metrics (`process="up"`)."""

    def __init__(
        self, targets: Callable[[], Mapping[str, str]], *, host: str = "0.0.0.0", port: int = 0, timeout_s: float = 3.0
    ) -> None:
        own = CollectorRegistry()
        add_process_metrics(own)
        self._children = _ChildMetrics(targets, timeout_s, {"up": own})
        registry = CollectorRegistry()
        registry.register(self._children)

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not news
                pass

        self._httpd = ThreadingHTTPServer((host, port), _Handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvrelay-node-metrics", daemon=True)

    def start(self) -> NodeMetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a serve_forever that was never started
            self._httpd.shutdown()
        self._httpd.server_close()
        self._children.close()
