"""What the live-incarnation check costs a replica's restart: RegisterReplica of a new incarnation.

Before a new incarnation takes a replica id whose registered one is within its lease, the broker
asks the old one's endpoint whether that incarnation is alive (grpc.health.v1, 1.5 s at most;
docs/broker.md, A second process of one replica id). This measures RegisterReplica of a new
incarnation over loopback to a real broker server (BrokerCore, BrokerServicer, the real probe), one
caller, cases alternating so the machine's load hits them alike:

  lapsed      the old lease lapsed: no probe (what every takeover cost before)
  same_port   the old one crashed and the new process listens on its port (a restart on one host):
              the probe reaches the new process, NOT_FOUND
  closed      the old one's port is closed (crashed, restarted elsewhere): connection refused
  alive       the old one answers: the newcomer is refused REPLICA_ID_IN_USE
  silent      the old one accepts connections but never answers (SIGSTOP): the probe's 1.5 s

    .venv/bin/python benchmarks/replica_takeover.py [--reps 100] [--silent-reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import time
import uuid

import grpc

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.service import BrokerServicer
from kvrelay.logging import configure_logging
from kvrelay.security import Credentials, server_options
from kvrelay.server import GrpcServer
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2

LEASE_S = 10.0
CASES = ("lapsed", "same_port", "closed", "alive")


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def _info(incarnation: str, endpoint: str) -> broker_pb2.ReplicaInfo:
    return broker_pb2.ReplicaInfo(
        replica_id="ar-0", role=common_pb2.REPLICA_ROLE_AR, incarnation_id=incarnation, layout_version=1,
        version="bench", endpoint=endpoint, max_tokens=64,
        geometry=common_pb2.KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=common_pb2.DTYPE_FLOAT32,
                                       page_size=4),
        parallelism=common_pb2.Parallelism(tensor_parallel_size=1, sequence_parallel_size=1),
        transport=common_pb2.TRANSPORT_KIND_GRPC_STREAM,
    )  # fmt: skip


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main(reps: int, silent_reps: int) -> None:
    from kvrelay import LAYOUT_VERSION

    clock = Clock()
    core = BrokerCore(None, clock=clock, lease_seconds=LEASE_S, journal_synchronous="OFF")
    server = grpc.aio.server(options=server_options(Credentials()))  # as every kvrelay server
    broker_pb2_grpc.add_BrokerServiceServicer_to_server(BrokerServicer(core), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    replica = GrpcServer(name="ar-0", host="127.0.0.1", port=0, registrations=[])  # the replica's own server
    await replica.start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = broker_pb2_grpc.BrokerServiceStub(channel)

    async def register(incarnation: str, endpoint: str) -> tuple[float, str]:
        info = _info(incarnation, endpoint)
        info.layout_version = LAYOUT_VERSION
        t0 = time.perf_counter()
        try:
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=info), timeout=10)
            outcome = "registered"
        except grpc.aio.AioRpcError as err:
            outcome = err.code().name
        return (time.perf_counter() - t0) * 1e3, outcome

    async def one(case: str) -> tuple[float, str]:
        old, new = uuid.uuid4().hex, uuid.uuid4().hex
        endpoint = {"closed": f"127.0.0.1:{_closed_port()}", "silent": f"127.0.0.1:{silent.getsockname()[1]}"}.get(
            case, replica.address
        )
        await register(old, endpoint)
        if case == "lapsed":
            clock.offset += LEASE_S + 1
        if case == "alive":
            await replica.announce_incarnation(old)
        if case == "same_port":
            await replica.announce_incarnation(new)  # the restarted process on the old one's port
        took, outcome = await register(new, endpoint)
        # Whichever holds the id now stops cleanly, so the next case's old one registers unasked.
        holder = core.registry.get("ar-0").spec.incarnation_id
        await stub.DeregisterReplica(broker_pb2.DeregisterReplicaRequest(replica_id="ar-0", incarnation_id=holder))
        return took, outcome

    times: dict[str, list[float]] = {c: [] for c in (*CASES, "silent")}
    outcomes: dict[str, set[str]] = {c: set() for c in times}
    try:
        for _ in range(reps):
            for case in CASES:
                took, outcome = await one(case)
                times[case].append(took)
                outcomes[case].add(outcome)
        for _ in range(silent_reps):
            took, outcome = await one("silent")
            times["silent"].append(took)
            outcomes["silent"].add(outcome)
    finally:
        silent.close()
        await channel.close()
        await replica.stop(0)
        await server.stop(0)
        core.close()

    base = statistics.median(times["lapsed"])
    print(f"RegisterReplica of a new incarnation, loopback, {reps} reps ({silent_reps} silent), cases alternating")
    print(f"{'case':<10} {'outcome':<16} {'p50 ms':>9} {'p99 ms':>9} {'p50 vs lapsed':>14}")
    for case, samples in times.items():
        if not samples:
            continue
        ordered = sorted(samples)
        p50 = statistics.median(ordered)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        print(f"{case:<10} {','.join(sorted(outcomes[case])):<16} {p50:>9.2f} {p99:>9.2f} {p50 / base:>13.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--silent-reps", type=int, default=3)
    args = parser.parse_args()
    configure_logging("ERROR")  # the broker's per-registration lines would drown the table
    asyncio.run(main(args.reps, args.silent_reps))
