"""Ownership checks of BrokerService: a replica acts only on its own replica id and its own tickets.

kvrelay.security's interceptor authenticates the caller and runs these checks (keyed by full
method name) before the servicer sees the request: PERMISSION_DENIED when a caller names an id
that is not its own, FAILED_PRECONDITION `WRONG_REPLICA` (the core's answer) when the ticket is
bound to another replica. Reads the core only (get_ticket); never mutates it, so a refused call changes nothing.
An unknown ticket passes through, so the servicer answers NOT_FOUND as it would to anyone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.tickets import BrokerError, Ticket
from kvrelay.errors import KvRelayServerError
from kvrelay.security import REPLICA_ID_METADATA, Caller, RequestCheck, permission_denied

_B = "/kvrelay.v1.BrokerService/"


def _missing(field: str) -> KvRelayServerError:
    return KvRelayServerError(
        grpc.StatusCode.INVALID_ARGUMENT, "MISSING_FIELD", f"{field}: required (the caller's replica id)", field=field
    )


def _wrong_replica(ticket_id: str, bound_to: str, caller: str) -> KvRelayServerError:
    # The answer the core gives an honest replica that names another replica's ticket.
    return KvRelayServerError(
        grpc.StatusCode.FAILED_PRECONDITION, "WRONG_REPLICA", f"ticket {ticket_id} is bound to {bound_to}, not {caller}"
    )


def _own_id(caller: Caller, replica_id: str, field: str) -> None:
    if not replica_id:
        raise _missing(field)
    if not caller.acts_as(replica_id):
        raise permission_denied(f"{field} {replica_id!r} is not the caller ({caller.replica_id or 'undeclared'})")


def broker_checks(core: BrokerCore) -> Mapping[str, RequestCheck]:
    """The per-RPC checks of BrokerService, for kvrelay.server.GrpcServer(checks=...)."""

    def ticket(ticket_id: str) -> Ticket | None:
        try:
            return core.get_ticket(ticket_id)
        except BrokerError:
            return None

    def ticket_side(side: str, field: str) -> Callable[[Any, Caller], None]:
        def check(request: Any, caller: Caller) -> None:
            replica_id = getattr(request, field)
            _own_id(caller, replica_id, field)
            t = ticket(request.ticket_id)
            owner = getattr(t, f"{side}_replica_id", None) if t is not None else None
            if owner is not None and owner != replica_id:
                raise _wrong_replica(request.ticket_id, f"{side.upper()} {owner}", replica_id)

        return check

    def either_side(request: Any, caller: Caller) -> None:
        if caller.operator:
            return
        t = ticket(request.ticket_id)
        if t is None:
            return
        if not (caller.acts_as(t.ar_replica_id) or caller.acts_as(t.dit_replica_id)):
            if caller.replica_id is None:
                raise permission_denied(f"ticket {request.ticket_id}: declare {REPLICA_ID_METADATA} or be an operator")
            raise _wrong_replica(request.ticket_id, f"AR {t.ar_replica_id} and DiT {t.dit_replica_id}", caller.replica_id)

    def register(request: Any, caller: Caller) -> None:
        _own_id(caller, request.replica.replica_id, "replica.replica_id")

    def heartbeat(request: Any, caller: Caller) -> None:
        _own_id(caller, request.replica_id, "replica_id")

    def deregister(request: Any, caller: Caller) -> None:
        if not caller.operator:
            _own_id(caller, request.replica_id, "replica_id")

    def operator_only(request: Any, caller: Caller) -> None:
        # With credentials the interceptor admits only operators; in a development deployment it
        # trusts everyone, and a caller declaring a replica id acts as that replica, not an operator.
        if not caller.operator:
            raise permission_denied(f"declared replica {caller.replica_id!r} is not an operator")

    return {
        _B + "RegisterReplica": register,
        _B + "Heartbeat": heartbeat,
        _B + "DeregisterReplica": deregister,
        _B + "ReserveTicket": ticket_side("ar", "ar_replica_id"),
        _B + "ReportWrite": ticket_side("ar", "replica_id"),
        _B + "ReportLoad": ticket_side("dit", "replica_id"),
        _B + "ReleaseTicket": ticket_side("dit", "replica_id"),
        _B + "StartConsuming": ticket_side("dit", "replica_id"),
        _B + "CancelTicket": either_side,
        _B + "GetTicket": either_side,
        _B + "WatchTicket": either_side,
        _B + "ForgetReplica": operator_only,
        _B + "ReloadCredentials": operator_only,
    }


__all__ = ["broker_checks"]
