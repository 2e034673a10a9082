"""An operator's DeregisterReplica of a replica that still runs.

Found black-box (`grpcurl ... BrokerService/DeregisterReplica` with the live dit-0's id and
incarnation, as the operator): the DiT went on heartbeating and serving (health SERVING, `kvrelay
up` content), the broker renewed its lease but never placed anything on it again: every Generate
failed `NO_DIT_REPLICA` until the process was restarted by hand, and `kvrelay status` said
`no (lease expired 0s ago)` beside a lease in the future. A replica's own deregistration (its
stop) keeps it out while it finishes its writes, as before; one made by anyone else is answered
at the replica's next heartbeat with `REPLICA_NOT_REGISTERED`, and the replica registers again
with its incarnation (what it does after a broker restart).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.tickets import NotFound
from kvrelay.security import REPLICA_ID_METADATA
from kvrelay.v1 import broker_pb2, broker_pb2_grpc
from tests.broker.helpers import ManualClock, dit_spec


def test_only_a_replica_deregistered_by_someone_else_is_told_to_register_again() -> None:
    clock = ManualClock()
    core = BrokerCore(None, clock=clock, lease_seconds=10.0, journal_synchronous="OFF")
    own, other = dit_spec("dit-0", num_pages=8), dit_spec("dit-1", num_pages=8)
    core.register_replica(own)
    core.register_replica(other)
    core.deregister_replica("dit-0", own.incarnation_id)  # its own stop: it beats on, stays out
    core.deregister_replica("dit-1", other.incarnation_id, by_replica=False)  # an operator's
    core.heartbeat("dit-0", own.incarnation_id)
    assert not core.registry.status(core.registry.get("dit-0"), clock()).up
    with pytest.raises(NotFound) as info:
        core.heartbeat("dit-1", other.incarnation_id)
    assert info.value.reason == "REPLICA_NOT_REGISTERED" and "deregistered by an operator" in info.value.message
    core.register_replica(other)  # the same incarnation again: up, placeable
    assert core.registry.status(core.registry.get("dit-1"), clock()).up
    core.heartbeat("dit-1", other.incarnation_id)
    core.close()


@pytest.mark.slow
def test_a_real_dit_deregistered_by_an_operator_registers_again_and_serves(tmp_path: Path) -> None:
    from tests.dit_service.harness import inprocess_broker, start_dit, wait_serving, write_config

    config = write_config(tmp_path, transport="mooncake", lease_seconds=1.0)

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=1.0) as (broker, core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                incarnation = core.registry.get("dit-0").spec.incarnation_id
                async with grpc.aio.insecure_channel(broker.address) as channel:
                    stub = broker_pb2_grpc.BrokerServiceStub(channel)
                    # Declaring another id is not the replica's own call: an operator's.
                    await stub.DeregisterReplica(
                        broker_pb2.DeregisterReplicaRequest(replica_id="dit-0", incarnation_id=incarnation),
                        metadata=((REPLICA_ID_METADATA, "ar-9"),), timeout=5,
                    )
                assert not core.registry.status(core.registry.get("dit-0"), time.monotonic()).up
                deadline = time.monotonic() + 20.0
                while time.monotonic() < deadline:
                    record = core.registry.get("dit-0")
                    if core.registry.status(record, time.monotonic()).up:
                        break
                    await asyncio.sleep(0.1)
                record = core.registry.get("dit-0")
                assert core.registry.status(record, time.monotonic()).up, "".join(dit.lines[-30:])
                assert record.spec.incarnation_id == incarnation  # the same process, registered again
                assert dit.proc.poll() is None
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())
