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
import socket
import threading
import time
import urllib.request
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.logging import get_logger, wrap_handler

log = get_logger(__name__)

# The metrics listeners (every process's own and the node's) serve a handful of scrapers. A
# connection that sends nothing for METRICS_IDLE_TIMEOUT_S is closed, and at most
# METRICS_MAX_CONNECTIONS are served at once (a further one is closed at once): each held a
# thread and a descriptor of the process it reports on, for good. Found black-box: silent TCP
# connections to the broker's metrics port grew it by a thread each (1279 and counting), and the
# descriptors they take are the ones its gRPC listener and journal need.
METRICS_IDLE_TIMEOUT_S = 10.0
METRICS_MAX_CONNECTIONS = 32
# How often a metrics listener's serve_forever looks whether it is to stop: its shutdown() waits
# up to this long (the default 0.5 s was added to every stop of every process).
METRICS_POLL_S = 0.05

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


class _BoundedConnections:
    """A mixin for socketserver's ThreadingMixIn servers: a thread per connection, at most
    METRICS_MAX_CONNECTIONS of them; a connection beyond that is closed without a thread."""

    # socketserver's listen backlog is 5: under a flood a scraper's connect waited for a retry.
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(METRICS_MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        try:
            super().process_request(request, client_address)  # type: ignore[misc]
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a scraper that timed out or hung up is not news (socketserver prints a traceback)


class _MetricsHttpServer(_BoundedConnections, ThreadingHTTPServer):
    daemon_threads = True


def _metrics_address(host: str, port: int) -> tuple[int, str]:
    # An IPv6 host needs an AF_INET6 socket (prometheus_client's start_http_server does the same).
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, str(sockaddr[0])


def start_metrics_server(host: str, port: int, registry: Any) -> ThreadingHTTPServer:
    """Serve `registry` on `http://host:port/metrics` from a daemon thread, connections bounded as
    above (prometheus_client's start_http_server keeps any number open for ever). The caller
    stops it with `shutdown()` and `server_close()`."""
    app = make_wsgi_app(registry)

    class _Server(_BoundedConnections, ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class _Handler(WSGIRequestHandler):
        timeout = METRICS_IDLE_TIMEOUT_S

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not news
            pass

    _Server.address_family, addr = _metrics_address(host, port)
    httpd = make_server(addr, port, app, _Server, handler_class=_Handler)
    threading.Thread(target=httpd.serve_forever, args=(METRICS_POLL_S,), name="kvrelay-metrics", daemon=True).start()
    return httpd  # type: ignore[return-value]


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
            timeout = METRICS_IDLE_TIMEOUT_S

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

        self._httpd = _MetricsHttpServer((host, port), _Handler)
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(METRICS_POLL_S,), name="kvrelay-node-metrics", daemon=True
        )

    def start(self) -> NodeMetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a serve_forever that was never started
            self._httpd.shutdown()
        self._httpd.server_close()
        self._children.close()
