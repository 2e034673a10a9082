"""The one gRPC server helper every kvrelay process uses.

grpc.aio server with health (`grpc.health.v1`, NOT_SERVING until the process says it can serve),
server reflection, a Prometheus endpoint, raised message-size limits (a 2048x2048 PNG fits), an
optional bearer token, and a graceful stop on SIGTERM/SIGINT. It owns no business logic.
"""

from __future__ import annotations

import asyncio
import errno
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvrelay.logging import get_logger, logging_interceptor
from kvrelay.metrics import add_process_metrics, rpc_metrics_for
from kvrelay.ports import PortInUse, in_use_message, is_port_free

# 2048x2048 RGB PNG worst case is ~12 MiB; KV fallback chunks are <= 1 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]

log = get_logger(__name__)

Registration = tuple[Callable[[Any, grpc.aio.Server], None], Any, str]
"""(add_XServicer_to_server, servicer instance, full service name)."""


class _BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls to the guarded services without `authorization: Bearer <token>`."""

    def __init__(self, token: str, guarded_prefixes: Sequence[str]) -> None:
        self._expected = f"Bearer {token}"
        self._guarded = tuple(guarded_prefixes)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        if details.method.startswith(self._guarded):
            metadata = dict(details.invocation_metadata or ())
            if metadata.get("authorization") != self._expected:
                return self._deny
        return await continuation(details)


@dataclass
class GrpcServer:
    name: str
    host: str
    port: int
    registrations: list[Registration]
    metrics_port: int | None = None
    metrics_registry: Any = None
    api_token: str | None = None
    guarded_prefixes: Sequence[str] = ()
    tls_cert: str | None = None
    tls_key: str | None = None
    bound_port: int = 0
    bound_metrics_port: int | None = None
    _server: grpc.aio.Server | None = field(default=None, repr=False)
    _health: Any = field(default=None, repr=False)
    _metrics: Any = field(default=None, repr=False)
    _stop: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.bound_port}"

    async def start(self) -> int:
        interceptors: list[Any] = [logging_interceptor()]
        registry = self._registry()
        if registry is not None:
            add_process_metrics(registry)
            # Outermost: it sees every call's final code, INVALID_ARGUMENT for malformed ones too.
            interceptors.insert(0, rpc_metrics_for(registry).interceptor())
        if self.api_token:
            interceptors.insert(0, _BearerTokenInterceptor(self.api_token, self.guarded_prefixes))
        server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
        names = [svc_name for _, _, svc_name in self.registrations]
        for add, servicer, _ in self.registrations:
            add(servicer, server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        _enable_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
        listen = f"{self.host}:{self.port}"
        try:
            if self.tls_cert and self.tls_key:
                with open(self.tls_key, "rb") as k, open(self.tls_cert, "rb") as c:
                    creds = grpc.ssl_server_credentials([(k.read(), c.read())])
                self.bound_port = server.add_secure_port(listen, creds)
            else:
                self.bound_port = server.add_insecure_port(listen)
        except RuntimeError:  # grpc's "Failed to bind to address"
            self.bound_port = 0
        if self.bound_port == 0:
            raise self._bind_error(self.port, "gRPC")
        await server.start()
        self._server = server
        await self.set_serving(False)
        if self.metrics_port is not None:
            self._start_metrics()
        log.info("grpc_listening", service=self.name, address=self.address, metrics_port=self.bound_metrics_port)
        return self.bound_port

    def _registry(self) -> Any:
        if self.metrics_registry is not None:
            return self.metrics_registry
        if self.metrics_port is None:
            return None
        import prometheus_client

        return prometheus_client.REGISTRY

    def _start_metrics(self) -> None:
        import prometheus_client

        registry = self._registry()
        try:
            httpd, _thread = prometheus_client.start_http_server(
                self.metrics_port or 0, addr=self.host, registry=registry
            )
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            raise self._bind_error(self.metrics_port or 0, "metrics") from None
        self._metrics = httpd
        self.bound_metrics_port = httpd.server_port

    def _bind_error(self, port: int, what: str) -> PortInUse:
        if port and not is_port_free(self.host, port):
            return PortInUse(f"{self.name}: " + in_use_message(port, f"{self.name} {what}", self.host))
        return PortInUse(f"{self.name}: cannot listen on {self.host}:{port} ({what})")

    async def set_serving(self, serving: bool = True) -> None:
        """Health turns SERVING only when the process can really serve (models loaded, memory registered)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        names = ["", *(svc_name for _, _, svc_name in self.registrations)]
        for svc in names:
            await self._health.set(svc, status)

    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def wait_for_stop(self) -> None:
        await self._stop.wait()

    async def stop(self, grace: float = 5.0) -> None:
        if self._server is not None:
            if self._health is not None:
                await self._health.enter_graceful_shutdown()
            await self._server.stop(grace)
            self._server = None
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
            self._metrics = None
        log.info("grpc_stopped", service=self.name)


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _reflection_v1_descriptor() -> None:
    """Put `grpc.reflection.v1` in the default descriptor pool (grpcio-reflection ships only
    v1alpha; v1 is the same messages under another package), so reflecting on it works too."""
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2

    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in proto.message_type:
        for fld in message.field:
            if fld.type_name.startswith(old):
                fld.type_name = fld.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    proto.name = "grpc/reflection/v1/reflection.proto"
    proto.package = "grpc.reflection.v1"
    proto.options.Clear()
    pool.Add(proto)


def _enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Server reflection as `grpc.reflection.v1` (current grpcurl, Postman, grpcui) and
    `grpc.reflection.v1alpha` (older tools), one servicer behind both names."""
    from grpc_reflection.v1alpha import reflection_pb2

    _reflection_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer(
        [*service_names, reflection.SERVICE_NAME, REFLECTION_V1]
    )
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for name in (reflection.SERVICE_NAME, REFLECTION_V1):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),))


def reserve_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for handing to child processes in tests)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
