"""`kvrelay health`: one `grpc.health.v1` Check against a kvrelay process; exit 0 only if SERVING.

Made for container healthchecks and scripts (compose runs it every few seconds in each service):
it imports no torch, no config and no service package, waits at most `--timeout` seconds, and
prints one line: `HOST:PORT: SERVING` on stdout, or on stderr `kvrelay health: HOST:PORT: ...` (the
prefix every subcommand's one-line error has). Exit codes: 0 SERVING, 1 reachable but not serving,
2 unreachable or an error (a `--service` the process does not know).
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.client._common import normalize_target
from kvrelay.client.cli import tls_problem
from kvrelay.security import ChannelSecurity, SecurityError, client_tls_from_files, make_sync_channel

DEFAULT_TARGET = "127.0.0.1:50051"


def check(
    target: str, service: str = "", timeout_s: float = 3.0, security: ChannelSecurity | None = None
) -> tuple[int, str]:
    """Ask `target` once; returns (exit code, one-line description). Never raises on RPC errors.
    A target without a port gets the broker's (gRPC alone would dial 443)."""
    target = normalize_target(target)
    with make_sync_channel(target, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            if code == grpc.StatusCode.NOT_FOUND:
                # grpc.health.v1's answer for a name it has no status of, with no text: say which.
                return 2, f"{target}: NOT_FOUND: no health status for service {service!r} (omit --service for the process)"
            name = code.name if code is not None else "ERROR"
            return 2, f"{target}: {name}: {err.details() if isinstance(err, grpc.Call) else err}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return (0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1), f"{target}: {status}"


def run(args: argparse.Namespace) -> int:
    try:
        tls = client_tls_from_files(
            getattr(args, "tls_ca", None) or os.environ.get("KVRELAY_TLS_CA"),
            getattr(args, "tls_cert", None) or os.environ.get("KVRELAY_TLS_CERT"),
            getattr(args, "tls_key", None) or os.environ.get("KVRELAY_TLS_KEY"),
        )
    except SecurityError as err:
        print(f"kvrelay health: {err}", file=sys.stderr)
        return 2
    if tls is not None and (problem := tls_problem(args)) is not None:
        # A --tls-cert/--tls-key that are no pair: gRPC's C-core log lines and `UNAVAILABLE:
        # empty address list` before (found black-box), as in kvrelay status.
        print(f"kvrelay health: {problem}", file=sys.stderr)
        return 2
    code, line = check(args.target, args.service, args.timeout, ChannelSecurity(tls=tls))
    if code == 0:
        print(line)
    else:
        print(f"kvrelay health: {line}", file=sys.stderr)
    return code
