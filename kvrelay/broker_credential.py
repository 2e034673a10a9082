"""Whether the broker takes this replica's credential, seen from an AR or DiT replica.

After the broker's replica secret changes (a broker restarted with a new one, or a
`kvrelay rotate-secrets` whose grace is over), a replica still holding a token derived from the
old secret is refused on every heartbeat (`UNAUTHENTICATED` /
`REPLICA_TOKEN_MISMATCH`): its lease lapses and the broker routes nothing to it. A token from a
file is re-read on each refusal (kvrelay.replica_token): a new one there is presented on the next
call, without a restart. Otherwise (the token in an environment variable, or the file still old)
stopping would not fix it, and would turn a broker misconfiguration into an outage of the whole
fleet: so it keeps heartbeating (a broker given its old secret back takes it again at once) and
makes the refusal impossible to miss. One log line `broker_refuses_credential` names the cause,
where the token came from and the fix (write the new token into the file; for an environment
variable, restart with the token `kvrelay token ID` prints), repeated at most every REPEAT_LOG_S;
`kvrelay_{ar,dit}_credential_refused` is 1 and gRPC health NOT_SERVING while it lasts, so a
readiness probe, `kvrelay health` and a scrape see it; `broker_accepts_credential` when it ends.

During a rotation's grace (HeartbeatResponse.credential_superseded) the replica is still taken:
`superseded` re-reads its token file at once, and warns (`credential_superseded`) while the file
holds no new token, so it is never refused when its file was written in time.

Owns the decision and the rate limit only: the registrations call it with what their calls
answered, `on_change` (the process's gauge and health) is theirs, the reload kvrelay.replica_token's.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import grpc

from kvrelay.errors import reason_of
from kvrelay.logging import get_logger
from kvrelay.replica_token import ReplicaToken
from kvrelay.security import CredentialSource

log = get_logger(__name__)

REPEAT_LOG_S: Final = 60.0


def credential_fix(replica_id: str, reason: str, source: CredentialSource | None = None) -> str:
    """What to do about a broker refusing `replica_id`'s credential with `reason`. `source` is
    where the running replica's token came from (None: a replica that is not running on, e.g. its
    first registration refused: it exits, and a restart reads its token again)."""
    if reason == "REPLICA_TOKEN_MISMATCH":
        cause = (
            f"the broker does not take this replica's token as {replica_id!r}: its replica secret "
            "(security.replica_secret_env / _file) changed (a rotation: every token changes) or this "
            "replica holds another id's token"
        )
        new = f"the token `kvrelay token {replica_id}` prints where the broker's secret is"
    else:
        cause = (
            "the broker takes no replica credential this replica presents: the deployment's replica token "
            "(security.replica_token_env / replica_token_file) differs from the broker's, or the broker now "
            "requires one (or a client certificate)"
        )
        new = "the broker's replica token"
    if source is not None and source.reloadable:
        return (
            f"{cause}; write {new} into {source.file}, replacing the file in one step (write a temporary file, "
            "then rename it over): this replica re-reads it on every refusal and presents the new token "
            "without a restart"
        )
    if source is not None and source.env:
        return (
            f"{cause}; this replica's token came from ${source.env}, which a running process cannot re-read: "
            f"restart it with {new} there (a token in security.replica_token_file is re-read without a restart)"
        )
    if reason == "REPLICA_TOKEN_MISMATCH":
        return f"{cause}; restart this replica with {new} (security.replica_token_env / replica_token_file)"
    return f"{cause}; restart this replica with {new}"


def superseded_fix(replica_id: str, source: CredentialSource | None, *, bound: bool) -> str:
    """What to do when the broker's credentials were rotated and this replica still holds the
    token it replaced (taken until the grace ends)."""
    new = (f"the token `kvrelay token {replica_id}` prints where the broker's new secret is" if bound
           else "the broker's new replica token")  # fmt: skip
    if source is not None and source.reloadable:
        return (f"write {new} into {source.file}, replacing the file in one step (write a temporary file, then "
                "rename it over): this replica re-reads it at its next heartbeat, before the grace ends")
    if source is not None and source.env:
        return (f"this replica's token came from ${source.env}, which a running process cannot re-read: restart it "
                f"with {new} there before the grace ends (a token in security.replica_token_file is re-read "
                "without a restart)")
    return f"restart this replica with {new} before the grace ends"


class BrokerCredentialWatch:
    """One replica's view of whether the broker takes its credential."""

    def __init__(
        self,
        replica_id: str,
        *,
        on_change: Callable[[bool], Awaitable[None]] | None = None,
        repeat_log_s: float = REPEAT_LOG_S,
        clock: Callable[[], float] = time.monotonic,
        token: ReplicaToken | None = None,
    ) -> None:
        self.replica_id = replica_id
        # Re-read on every refusal when its token came from a file (kvrelay.replica_token).
        self.token = token
        self._on_change = on_change
        self._repeat_log_s = repeat_log_s
        self._clock = clock
        self._since: float | None = None
        self._next_log = 0.0
        self._next_superseded_log = 0.0
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
        reload = await self.token.reload() if self.token is not None else None
        if reload is not None and reload.reloaded:
            # A new token from the file (logged credential_reloaded): the next call presents it.
            # Not a refusal of that one, so no NOT_SERVING for a rotation whose token files were
            # written before the broker restarted.
            return True
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
                token_source=self.token.source.describe() if self.token is not None else "unknown",
                token_file=(reload.error or reload.state) if reload is not None else "not reloadable",
                fix=credential_fix(self.replica_id, reason, self.token.source if self.token is not None else None),
                consequence="the broker routes nothing to this replica until it takes its credential",
            )
        if first:
            await self._changed(True)
        return True

    async def superseded(self, grace_s: float) -> None:
        """The broker took a heartbeat of this replica only by credentials a rotation of its own
        replaced (HeartbeatResponse.credential_superseded), for `grace_s` more seconds: re-read
        the token file now, so the new token is presented before the grace ends. Asked at every
        such heartbeat: a token written into the file after the rotation is taken at the next
        one. A file still holding the old token (or a token from the environment) is warned
        about, at most once per REPEAT_LOG_S: this replica is refused once the grace ends."""
        reload = await self.token.reload() if self.token is not None else None
        if reload is not None and reload.reloaded:
            return  # logged credential_reloaded; the next call presents the new token
        now = self._clock()
        if now < self._next_superseded_log:
            return
        self._next_superseded_log = now + self._repeat_log_s
        source = self.token.source if self.token is not None else None
        log.warning(
            "credential_superseded",
            replica_id=self.replica_id,
            grace_seconds=round(grace_s, 1),
            token_source=source.describe() if source is not None else "unknown",
            token_file=(reload.error or reload.state) if reload is not None else "not reloadable",
            fix=superseded_fix(self.replica_id, source,
                               bound=self.token is not None and self.token.current.bound_replica_tokens),
            consequence="the broker takes this replica's token only until the grace ends, then refuses it",
        )  # fmt: skip

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
