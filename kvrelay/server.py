"""The one gRPC server helper every kvrelay process uses.

grpc.aio server with health (`grpc.health.v1`, NOT_SERVING until the process says it can serve),
server reflection, a Prometheus endpoint, explicit message-size limits (a 2048x2048 PNG fits in a
reply), kvrelay.security's interceptor (caller classes, tokens, mutual TLS) and TLS listener, the
refusal of a non-loopback listener without credentials, and a graceful stop that a fast stop
(kvrelay/stopping.py: a second signal) cuts short. It owns no business logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvrelay.logging import get_logger, logging_interceptor
from kvrelay.metrics import add_process_metrics, rpc_metrics_for, start_metrics_server
from kvrelay.ports import PortInUse, in_use_message, is_port_free, pick_free_port
from kvrelay.security import (
    RPC_RULES,
    AuthInterceptor,
    CredentialRefusals,
    CredentialRotation,
    Credentials,
    RequestCheck,
    RequestMessageDeadline,
    RpcRule,
    check_bind,
    server_credentials,
    server_options,
)
from kvrelay.server_tls import ServerCertificates
from kvrelay.stopping import ProcessStop, run_on_own_thread

# 2048x2048 RGB PNG worst case is ~12 MiB; KV fallback chunks are <= 1 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]

log = get_logger(__name__)

# The grpc.health.v1 service name under which a replica process answers for its incarnation:
# the broker asks it (kvrelay.broker.service.grpc_incarnation_probe) before it lets a new
# incarnation take a replica id whose registered one is within its lease. A digest, never the id
# itself: health is public, and the incarnation id is what a replica's reports are checked by.
INCARNATION_SERVICE_PREFIX = "kvrelay.incarnation."


def incarnation_health_service(incarnation_id: str) -> str:
    """The health service name a process of `incarnation_id` answers (NOT_FOUND from any other)."""
    return INCARNATION_SERVICE_PREFIX + hashlib.sha256(incarnation_id.encode()).hexdigest()[:32]


Registration = tuple[Callable[[Any, grpc.aio.Server], None], Any, str]
"""(add_XServicer_to_server, servicer instance, full service name)."""


@dataclass
class GrpcServer:
    name: str
    host: str
    port: int
    registrations: list[Registration]
    metrics_port: int | None = None
    metrics_registry: Any = None
    # None = a development server: plaintext, every caller trusted (loopback only).
    credentials: Credentials | None = None
    # Per-RPC checks after authentication (full method name -> check), e.g. broker ownership.
    checks: Mapping[str, RequestCheck] = field(default_factory=dict)
    # Listen on a non-loopback address without any credential (refused otherwise).
    insecure_bind: bool = False
    # The caller class of every RPC served (kvrelay.security.RPC_RULES); an RPC missing is refused.
    rules: Mapping[str, RpcRule] = field(default_factory=lambda: RPC_RULES)
    # The replica ids this server refuses for their credential (the broker lists its own).
    credential_refusals: CredentialRefusals = field(default_factory=CredentialRefusals)
    # What the server takes across a reload of its credentials (the broker's is shared with what
    # reloads them and with its orchestrator's channels); one of `credentials` alone by default.
    credential_rotation: CredentialRotation | None = None
    # The certificate and key served, swappable while serving (the broker's: `kvrelay
    # rotate-secrets`, kvrelay.server_tls); None: those of `credentials`, fixed.
    server_certificates: ServerCertificates | None = None
    bound_port: int = 0
    bound_metrics_port: int | None = None
    _server: grpc.aio.Server | None = field(default=None, repr=False)
    _health: Any = field(default=None, repr=False)
    _metrics: Any = field(default=None, repr=False)
    _auth: AuthInterceptor | None = field(default=None, repr=False)
    _requests: RequestMessageDeadline | None = field(default=None, repr=False)
    # grpc.aio's own serving task of this server (None: not found, see _live_rpc_tasks).
    _serving_task: asyncio.Task[Any] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.bound_port}"

    async def start(self) -> int:
        creds = self.credentials or Credentials()
        check_bind(self.host, creds, self.insecure_bind, self.name)
        # Logging outside authorization: an undecodable request is INVALID_ARGUMENT before anything
        # else runs, and the authorization's own lines carry the request's ids.
        if self.credential_rotation is None:
            self.credential_rotation = CredentialRotation(creds)
        self._auth = AuthInterceptor(creds, self.checks, self.rules, self.credential_refusals,
                                     rotation=self.credential_rotation)  # fmt: skip
        # Outermost but metrics: a unary request is read (within a bound) before anything else.
        self._requests = RequestMessageDeadline()
        interceptors: list[Any] = [self._requests, logging_interceptor(), self._auth]
        registry = self._registry()
        if registry is not None:
            add_process_metrics(registry)
            # Outermost: it sees every call's final code, INVALID_ARGUMENT for malformed ones too.
            interceptors.insert(0, rpc_metrics_for(registry).interceptor())
        server = grpc.aio.server(options=server_options(creds), interceptors=interceptors)
        names = [svc_name for _, _, svc_name in self.registrations]
        for add, servicer, _ in self.registrations:
            add(servicer, server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        _enable_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
        listen = f"{self.host}:{self.port}"
        tls = self.server_certificates.credentials() if self.server_certificates is not None else server_credentials(creds)
        # Checked before gRPC tries (its own failed bind also logs a multi-line C-core error): a
        # port in use names its holder, an address this host does not have says so.
        try:
            free = is_port_free(self.host, self.port)
        except OSError as err:
            raise PortInUse(f"cannot listen on {self.host}:{self.port} ({self.name} gRPC): {err.strerror}") from None
        if not free:
            raise self._bind_error(self.port, "gRPC")
        try:
            if tls is not None:
                self.bound_port = server.add_secure_port(listen, tls)
            else:
                self.bound_port = server.add_insecure_port(listen)
        except RuntimeError:  # grpc's "Failed to bind to address"
            self.bound_port = 0
        if self.bound_port == 0:
            raise self._bind_error(self.port, "gRPC")
        tasks_before = asyncio.all_tasks()
        await server.start()
        self._serving_task = _serving_task_of(asyncio.all_tasks() - tasks_before)
        self._server = server
        await self.set_serving(False)
        if self.metrics_port is not None:
            try:
                self._start_metrics()
            except BaseException:
                # A metrics port in use: the gRPC server already listens, and left running it
                # kept the process from exiting after its one error line.
                self._server = None
                await server.stop(None)
                raise
        log.info("grpc_listening", service=self.name, address=self.address, metrics_port=self.bound_metrics_port)
        return self.bound_port

    def replace_credentials(self, creds: Credentials) -> None:
        """What every call admitted from now on is checked against (a replica that reloaded its
        token file, kvrelay.replica_token: the broker's call tokens and the AR write tokens derive
        from it), and for `creds.rotation_grace_s` more the credentials it replaces: a broker that
        has not yet seen this replica's new token, or an AR handed a write token before, still
        present the old ones (kvrelay.security.CredentialRotation). Calls already admitted run
        on; listening options and TLS stay as started."""
        self.credentials = creds
        if self.credential_rotation is None:
            self.credential_rotation = CredentialRotation(creds)
        else:
            self.credential_rotation.rotate(creds)

    def _registry(self) -> Any:
        if self.metrics_registry is not None:
            return self.metrics_registry
        if self.metrics_port is None:
            return None
        import prometheus_client

        return prometheus_client.REGISTRY

    def _start_metrics(self) -> None:
        registry = self._registry()
        try:
            httpd = start_metrics_server(self.host, self.metrics_port or 0, registry)
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            raise self._bind_error(self.metrics_port or 0, "metrics") from None
        self._metrics = httpd
        self.bound_metrics_port = httpd.server_port

    def _taken(self, port: int) -> bool:
        try:
            return bool(port) and not is_port_free(self.host, port)
        except OSError:  # e.g. an address this host does not have: the bind itself says so
            return False

    def _bind_error(self, port: int, what: str) -> PortInUse:
        # The server's name is in the parentheses ("broker gRPC"), never a prefix: the process
        # prints these after its own "kvrelay broker: " (it read "kvrelay broker: broker: port ...").
        if self._taken(port):
            return PortInUse(in_use_message(port, f"{self.name} {what}", self.host))
        return PortInUse(f"cannot listen on {self.host}:{port} ({self.name} {what})")

    async def set_serving(self, serving: bool = True) -> None:
        """Health turns SERVING only when the process can really serve (models loaded, memory registered)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        names = ["", *(svc_name for _, _, svc_name in self.registrations)]
        for svc in names:
            await self._health.set(svc, status)

    async def announce_incarnation(self, incarnation_id: str) -> None:
        """Answer health checks for `incarnation_health_service(incarnation_id)` from now on (a
        replica, before it registers): the broker's proof that this incarnation is alive."""
        await self._health.set(incarnation_health_service(incarnation_id), health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float = 5.0, *, fast: ProcessStop | None = None) -> None:
        """Stop serving: running RPCs get `grace` seconds, then are cancelled; once none runs,
        the stop ends (see `_stop_when_idle`). With `fast`, a fast stop (requested before or
        during the grace) cancels them at once instead."""
        server = self._server
        if server is not None:
            if self._health is not None:
                await self._health.enter_graceful_shutdown()
            if fast is None:
                await self._stop_when_idle(server, grace)
            elif not await fast.unless_fast(self._stop_when_idle(server, grace)):
                # A later stop with a smaller grace wins (grpc.aio.Server.stop): None cancels now.
                await server.stop(None)
            self._server = None
        if self._metrics is not None:
            httpd, self._metrics = self._metrics, None
            # Off the loop: shutdown() waits for serve_forever's next poll (kvrelay.metrics.METRICS_POLL_S).
            await run_on_own_thread(httpd.shutdown, "kvrelay-metrics-stop")
            httpd.server_close()
        log.info("grpc_stopped", service=self.name)

    async def _stop_when_idle(self, server: grpc.aio.Server, grace: float) -> None:
        """`server.stop(grace)`, ended as soon as no RPC runs any more (at once if none does).

        grpc's graceful stop completes only when every connection to the server is closed, not
        when its last call ended: an idle channel of another process (the supervisor's health
        checks, the broker's channels to a replica and theirs to it) closes some seconds after
        the GOAWAY (about 5 s; one whose process reads nothing, at the keepalive timeout), so
        every idle stop waited out its whole grace (AR 1 s, broker 2 s, DiT 5 s). Once no RPC
        is live, `stop(None)` cancels nothing running and closes those connections now.
        Running RPCs still get their grace: only when the last one ended is the stop cut."""
        stopping = asyncio.ensure_future(server.stop(grace))
        idle = asyncio.ensure_future(self._no_live_rpc())
        try:
            await asyncio.wait({stopping, idle}, return_when=asyncio.FIRST_COMPLETED)
            if not stopping.done() and idle.done() and idle.result():
                await server.stop(None)
            await stopping
        finally:
            idle.cancel()
            if not stopping.done():  # cancelled by a fast stop: the caller stops it with None
                stopping.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await stopping

    async def _no_live_rpc(self) -> bool:
        """True once the stopping server accepts no more calls and every call it accepted ended;
        False if that cannot be known (then the whole grace is waited, as grpc does)."""
        serving = self._serving_task
        if serving is None:
            return False
        # Its end means grpc's last request for a call was answered: every call C-core handed
        # over has its task (and a call that comes after the GOAWAY is refused by C-core).
        await asyncio.wait({serving})
        while True:
            live = _live_rpc_tasks()
            if not live:
                return True
            await asyncio.wait(live)


# The coroutine names of grpc.aio's server internals (grpc/_cython/_cygrpc/aio/server.pyx.pxi):
# `AioServer._server_main_loop` requests calls from C-core and makes a `_schedule_rpc_coro` task
# of each, which lives until C-core says the call is closed (its status sent, or cancelled) and
# starts the handler's own task, `_handle_exceptions` (which may run on after its caller left: a
# handler's `finally`). A call is live while either task is. No public API says whether a
# stopping server still has calls; a grpc that renames these only makes an idle stop wait out
# its grace again (tests/foundation/test_server_stop.py says so).
_SERVING_LOOP = "_server_main_loop"
_RPC_TASKS = frozenset({"_schedule_rpc_coro", "_handle_exceptions"})


def _coroutine_name(task: asyncio.Task[Any]) -> str:
    return str(getattr(task.get_coro(), "__name__", ""))


def _serving_task_of(started: set[asyncio.Task[Any]]) -> asyncio.Task[Any] | None:
    found = [task for task in started if _coroutine_name(task) == _SERVING_LOOP]
    return found[0] if len(found) == 1 else None


def _live_rpc_tasks() -> set[asyncio.Task[Any]]:
    """The calls of every grpc.aio server on this loop (another server's calls too: they only
    make a stop wait longer, never shorter)."""
    return {task for task in asyncio.all_tasks() if not task.done() and _coroutine_name(task) in _RPC_TASKS}

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
    """A port that was free a moment ago (for handing to child processes in tests and benches):
    outside the ephemeral range, never the same twice in this process."""
    return pick_free_port(host)
