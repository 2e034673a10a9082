"""A kvrelay server (kvrelay.server.GrpcServer, its real interceptor under the credentials and rules
a test gives) whose methods are stubs that answer OK: for the tests of what the interceptor decides
(rate limits, who may call what), on a real socket (port 0), in the test's own event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import grpc
from grpc_health.v1 import health_pb2

from kvrelay.errors import reason_of
from kvrelay.security import RPC_RULES, ChannelSecurity, Credentials, RpcRule, make_channel
from kvrelay.server import GrpcServer


async def _ok(request: health_pb2.HealthCheckRequest, context: object) -> health_pb2.HealthCheckResponse:
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def stub_methods(service: str, methods: tuple[str, ...]) -> Callable[[object, grpc.aio.Server], None]:
    """A registration for GrpcServer: `service`'s `methods`, each unary and answering OK (what the
    method really streams does not matter: its rule and limit are the method name's)."""

    def add(_: object, server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(
            _ok,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, dict.fromkeys(methods, handler)),)
        )

    return add


@asynccontextmanager
async def stub_server(
    credentials: Credentials,
    services: Mapping[str, tuple[str, ...]],
    rules: Mapping[str, RpcRule] = RPC_RULES,
    name: str = "stub",
) -> AsyncIterator[str]:
    """A started server with the stub `services` (service name -> its methods); yields its address."""
    registrations = [(stub_methods(service, methods), None, service) for service, methods in services.items()]
    server = GrpcServer(name, "127.0.0.1", 0, registrations, credentials=credentials, rules=rules)
    await server.start()
    try:
        yield server.address
    finally:
        await server.stop(0.1)


async def outcomes(address: str, security: ChannelSecurity, method: str, calls: int) -> list[str]:
    """The code and reason of `calls` calls of `method` in a row, one channel ("OK" for a success)."""
    out = []
    async with make_channel(address, security) as channel:
        call = channel.unary_unary(method)
        request = health_pb2.HealthCheckRequest().SerializeToString()
        for _ in range(calls):
            try:
                await call(request, timeout=5)
                out.append("OK")
            except grpc.aio.AioRpcError as err:
                out.append("/".join(reason_of(err)[:2]))
    return out
