"""What bound replica tokens cost the broker: shared vs bound (security.replica_tokens).

Two measures, side by side, alternating modes so the machine's load hits both alike:
  1. `AuthInterceptor.authenticate` in-process (no sockets): microseconds per call for a replica
     declaring its id (shared token; bound: the broker derives the id's token with one HMAC-SHA256;
     a replica checking the broker's call token: two).
  2. `BrokerService/Heartbeat` over loopback gRPC to a real broker server (BrokerCore, the
     interceptor and the ownership checks): p50 / p99 milliseconds per call, one caller.

    .venv/bin/python benchmarks/auth_tokens.py [--calls 50000] [--rpcs 2000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from kvrelay.security import (
    AUTHORIZATION_METADATA,
    REPLICA_ID_METADATA,
    AuthInterceptor,
    ChannelSecurity,
    Credentials,
    broker_call_token,
    make_channel,
    replica_token_for,
)

SECRET = "bench-secret-0123456789abcdef"
SHARED = "bench-shared-replica-token"


def modes() -> dict[str, tuple[Credentials, str, str]]:
    """mode -> (server credentials, bearer a replica presents, id it declares)."""
    dit0 = replica_token_for(SECRET, "dit-0")
    return {
        "shared": (Credentials(replica_token=SHARED, rate_limit_per_second=0.0), SHARED, "dit-0"),
        "bound": (Credentials(bound_replica_tokens=True, replica_secret=SECRET, rate_limit_per_second=0.0),
                  dit0, "dit-0"),
        "bound_replica": (Credentials(bound_replica_tokens=True, replica_token=dit0, rate_limit_per_second=0.0),
                          broker_call_token(dit0), "broker"),
    }  # fmt: skip


def authenticate_us(creds: Credentials, token: str, declared: str, calls: int) -> float:
    interceptor = AuthInterceptor(creds)
    metadata = [(AUTHORIZATION_METADATA, f"Bearer {token}"), (REPLICA_ID_METADATA, declared)]
    t0 = time.perf_counter()
    for _ in range(calls):
        interceptor.authenticate(metadata, {})
    return (time.perf_counter() - t0) / calls * 1e6


async def heartbeat_ms(creds: Credentials, token: str, rpcs: int, tmp: Path) -> tuple[float, float]:
    from kvrelay.broker.authz import broker_checks
    from kvrelay.broker.core import BrokerCore
    from kvrelay.broker.service import BrokerServicer
    from kvrelay.server import GrpcServer
    from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
    from tests.broker.test_grpc import replica

    core = BrokerCore(tmp / f"j-{time.monotonic_ns()}.sqlite", lease_seconds=600.0)
    server = GrpcServer(
        name="broker", host="127.0.0.1", port=0, credentials=creds, checks=broker_checks(core),
        registrations=[(broker_pb2_grpc.add_BrokerServiceServicer_to_server, BrokerServicer(core, 5.0),
                        "kvrelay.v1.BrokerService")],
    )  # fmt: skip
    await server.start()
    try:
        async with make_channel(server.address, ChannelSecurity(token=token, replica_id="dit-0")) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            info = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=info), timeout=10)
            request = broker_pb2.HeartbeatRequest(replica_id="dit-0", incarnation_id=info.incarnation_id)
            for _ in range(50):
                await stub.Heartbeat(request, timeout=10)
            times = []
            for _ in range(rpcs):
                t0 = time.perf_counter()
                await stub.Heartbeat(request, timeout=10)
                times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return statistics.median(times), times[int(len(times) * 0.99) - 1]
    finally:
        await server.stop(0.5)
        core.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--rpcs", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    auth: dict[str, list[float]] = {m: [] for m in modes()}
    rpc: dict[str, list[tuple[float, float]]] = {"shared": [], "bound": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):
            for mode, (creds, token, declared) in modes().items():
                auth[mode].append(authenticate_us(creds, token, declared, args.calls))
            for mode in rpc:
                creds, token, _ = modes()[mode]
                rpc[mode].append(asyncio.run(heartbeat_ms(creds, token, args.rpcs, Path(tmp))))
    print(f"authenticate, us per call (median of {args.runs} runs x {args.calls} calls):")
    med = {m: statistics.median(v) for m, v in auth.items()}
    for mode, value in med.items():
        print(f"  {mode:14s} {value:7.2f}  ({value / med['shared']:.2f}x shared)  runs {[round(v, 2) for v in auth[mode]]}")
    print(f"Heartbeat over loopback, ms (median over {args.runs} runs of {args.rpcs} calls' p50 / p99):")
    p50 = {m: statistics.median(p for p, _ in v) for m, v in rpc.items()}
    p99 = {m: statistics.median(q for _, q in v) for m, v in rpc.items()}
    for mode in rpc:
        print(f"  {mode:14s} p50 {p50[mode]:.3f}  p99 {p99[mode]:.3f}  ({p50[mode] / p50['shared']:.2f}x shared p50)")


if __name__ == "__main__":
    main()
