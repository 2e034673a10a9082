"""Whether the broker takes this replica's credential, seen from an AR or DiT replica.

After the broker's replica secret changes and the broker restarts, a replica still holding a token
derived from the old secret is refused on every heartbeat (`UNAUTHENTICATED` /
`REPLICA_TOKEN_MISMATCH`): its lease lapses and the broker routes nothing to it. Nothing the
replica can do fixes that (the token is given at start), and stopping it would turn a broker
misconfiguration into an outage of the whole fleet: so it keeps heartbeating (a broker given its
old secret back takes it again at once) and makes the refusal impossible to miss. One log line
`broker_refuses_credential` names the cause and the fix (restart it with the token `kvrelay token
ID` prints), repeated at most every REPEAT_LOG_S; `kvrelay_{ar,dit}_credential_refused` is 1 and
gRPC health NOT_SERVING while it lasts, so a readiness probe, `kvrelay health` and a scrape see
it; `broker_accepts_credential` when it ends.

Owns the decision and the rate limit only: the registrations call it with what their calls
answered, and `on_change` (the process's gauge and health) is theirs.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import grpc

from kvrelay.errors import reason_of
from kvrelay.logging import get_logger

log = get_logger(__name__)

REPEAT_LOG_S: Final = 60.0


def credential_fix(replica_id: str, reason: str) -> str:
    """What to do about a broker refusing `replica_id`'s credential with `reason`."""
    if reason == "REPLICA_TOKEN_MISMATCH":
        return (
            f"the broker does not take this replica's token as {replica_id!r}: its replica secret "
            "(security.replica_secret_env / _file) changed (a rotation: every token changes) or this "
            f"replica holds another id's token; restart this replica with the token `kvrelay token {replica_id}` "
            "prints where the broker's secret is (security.replica_token_env / replica_token_file)"
        )
    return (
        "the broker takes no replica credential this replica presents: the deployment's replica token "
        "(security.replica_token_env / replica_token_file) differs from the broker's, or the broker now "
        "requires one (or a client certificate); restart this replica with the broker's"
    )


class BrokerCredentialWatch:
    """One replica's view of whether the broker takes its credential."""

    def __init__(
        self,
        replica_id: str,
        *,
        on_change: Callable[[bool], Awaitable[None]] | None = None,
        repeat_log_s: float = REPEAT_LOG_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replica_id = replica_id
        self._on_change = on_change
        self._repeat_log_s = repeat_log_s
        self._clock = clock
        self._since: float | None = None
        self._next_log = 0.0
        self.refusals = 0

    @property
    def refused(self) -> bool:
        """True from a refusal until the broker takes a call of this replica again."""
        return self._since is not None

    async def answered(self, call: str, err: grpc.RpcError) -> bool:
        """A broker call (`call`: "Heartbeat", "RegisterReplica") that failed with `err`: True
        when it was the broker refusing the credential (logged here, rate-limited), False for
        anything else (the caller's to handle)."""
        if not isinstance(err, grpc.RpcError) or err.code() != grpc.StatusCode.UNAUTHENTICATED:
            return False
        _, reason, message = reason_of(err)
        now = self._clock()
        first = self._since is None
        if first:
            self._since = now
        self.refusals += 1
        if first or now >= self._next_log:
            self._next_log = now + self._repeat_log_s
            log.error(
                "broker_refuses_credential",
                replica_id=self.replica_id,
                call=call,
                reason=reason,
                message=message,
                refusals=self.refusals,
                refused_for_s=round(now - (self._since or now), 1),
                fix=credential_fix(self.replica_id, reason),
                consequence="the broker routes nothing to this replica until it takes its credential",
            )
        if first:
            await self._changed(True)
        return True

    async def accepted(self) -> None:
        """A broker call of this replica got through authentication."""
        if self._since is None:
            return
        log.info(
            "broker_accepts_credential",
            replica_id=self.replica_id,
            refusals=self.refusals,
            refused_for_s=round(self._clock() - self._since, 1),
        )
        self._since = None
        self.refusals = 0
        await self._changed(False)

    async def _changed(self, refused: bool) -> None:
        if self._on_change is None:
            return
        try:
            await self._on_change(refused)
        except Exception:  # noqa: BLE001 - the gauge or health failing must not end the heartbeats
            log.exception("credential_state_not_shown", replica_id=self.replica_id, refused=refused)


def credential_refused_gauge(role: str, registry: Any) -> Any:
    """`kvrelay_{role}_credential_refused` on a replica's registry (`role`: "ar" or "dit": every
    kvrelay metric belongs to one kind of process)."""
    from prometheus_client import Gauge

    return Gauge(
        f"kvrelay_{role}_credential_refused",
        "1 while the broker refuses this replica's credential (UNAUTHENTICATED: a rotated replica secret, "
        "another id's token); log broker_refuses_credential says the fix",
        registry=registry,
    )
