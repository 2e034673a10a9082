"""Logging: ids bound through contextvars, robust to grpc finalising handlers elsewhere."""

from __future__ import annotations


def test_bind_request_tolerates_a_reset_from_another_context() -> None:
    import contextvars

    import structlog

    from kvrelay.logging import bind_request

    # A stream handler's generator can be finalised from another context (grpc cancels it).
    gen_ctx = contextvars.copy_context()
    cm = bind_request(request_id="r-1")
    gen_ctx.run(cm.__enter__)
    cm.__exit__(None, None, None)  # in this context: must not raise
    assert "request_id" not in structlog.contextvars.get_contextvars()


# A server in its own process that stops (with a grace, as kvrelay's do) while a client's channel
# to it is open; the client calls again, and gRPC core reads the server's GOAWAY.
_STOPPING_SERVER = """
import asyncio, signal
import grpc
from grpc_health.v1 import health, health_pb2_grpc
async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1.0)
asyncio.run(main())
"""

_CLIENT = """
import socket, subprocess, sys
import grpc
from concurrent import futures
from grpc_health.v1 import health_pb2, health_pb2_grpc
server = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
port = int(server.stdout.readline())
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
server.terminate()
server.wait(10)
try:
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
except grpc.RpcError:
    pass
channel.close()
# A real error of gRPC core: a bind to a port in use.
with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        grpc.server(futures.ThreadPoolExecutor(1)).add_insecure_port(f"127.0.0.1:{busy.getsockname()[1]}")
    except RuntimeError:
        pass
"""


def test_grpc_cores_routine_lines_are_off_and_its_errors_are_not() -> None:
    """Every stop of `kvrelay up` printed absl's "All log messages before absl::InitializeLog()"
    and gRPC core's "chttp2_transport.cc ... Got goaway" (INFO) on stderr; the environment kvrelay
    gives its processes and children (GRPC_VERBOSITY=ERROR unless set) keeps gRPC's errors only."""
    import os
    import subprocess
    import sys

    from kvrelay.logging import with_quiet_grpc_core

    base = {k: v for k, v in os.environ.items() if k not in ("GRPC_VERBOSITY", "GRPC_TRACE")}

    def stderr_of(env: dict[str, str]) -> str:
        done = subprocess.run([sys.executable, "-c", _CLIENT, _STOPPING_SERVER], env=env, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stderr

    # Without it, the noise this guards against (if gRPC stops printing it, this says so).
    assert "Got goaway" in stderr_of(base)
    quiet = stderr_of(with_quiet_grpc_core(base))
    assert "Got goaway" not in quiet and "chttp2_transport" not in quiet, quiet
    assert "Address already in use" in quiet, quiet  # a real error still prints
    # The user's choice wins: a verbosity, or traces (INFO lines, which ERROR would hide).
    assert with_quiet_grpc_core({**base, "GRPC_VERBOSITY": "INFO"})["GRPC_VERBOSITY"] == "INFO"
    assert "GRPC_VERBOSITY" not in with_quiet_grpc_core({**base, "GRPC_TRACE": "http"})
