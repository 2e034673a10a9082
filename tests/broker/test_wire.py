"""The broker's domain enums map onto the proto's by name, total both ways (broker/wire.py)."""

from __future__ import annotations

import enum

import pytest

from kvrelay.broker import generation, service
from kvrelay.broker.generations import GenState
from kvrelay.broker.registry import ReplicaRole
from kvrelay.broker.tickets import TicketOutcome, TicketState, WriteStatus
from kvrelay.broker.wire import wire_enum
from kvrelay.v1 import broker_pb2, common_pb2, generation_pb2


@pytest.mark.parametrize(
    "mapped, domain, proto",
    [
        (generation._STATE, GenState, generation_pb2.GenerationState),
        (service._STATE, TicketState, broker_pb2.TicketState),
        (service._OUTCOME, TicketOutcome, broker_pb2.TicketOutcome),
        (service._WRITE_STATUS, WriteStatus, common_pb2.WriteStatus),
        (service._ROLE, ReplicaRole, common_pb2.ReplicaRole),
    ],
)
def test_every_broker_enum_maps_onto_every_value_of_its_proto_enum(mapped, domain, proto) -> None:  # type: ignore[no-untyped-def]
    assert set(mapped.to_pb) == set(domain)
    assert set(mapped.to_pb.values()) | {0} == set(proto.values())
    for member, number in mapped.to_pb.items():
        assert mapped.from_pb[number] is member
        assert proto.Name(number).endswith(member.name) or member is WriteStatus.PENDING


def test_pending_is_the_wires_unspecified() -> None:
    assert service._WRITE_STATUS.to_pb[WriteStatus.PENDING] == common_pb2.WRITE_STATUS_UNSPECIFIED


def test_a_proto_value_the_broker_lacks_fails_naming_it() -> None:
    class Outcome(enum.Enum):
        OK = "OK"
        CANCELLED = "CANCELLED"
        FAILED = "FAILED"

    with pytest.raises(ImportError, match="TICKET_OUTCOME_TIMED_OUT"):
        wire_enum(Outcome, broker_pb2.TicketOutcome, "TICKET_OUTCOME_")


def test_a_broker_member_the_proto_lacks_fails_naming_it() -> None:
    class Role(enum.Enum):
        AR = "AR"
        DIT = "DIT"
        VAE = "VAE"

    with pytest.raises(ImportError, match="REPLICA_ROLE_VAE"):
        wire_enum(Role, common_pb2.ReplicaRole, "REPLICA_ROLE_")
