"""A replica's own credential while it runs: where its token came from, and re-reading its file.

After the broker's replica secret (or the shared replica token) is rotated, a replica still on
its old token is told so at each heartbeat while the broker's grace lasts
(`credential_superseded`), then refused (kvrelay.broker_credential). A token from a file
(`security.replica_token_file`) is re-read, bounded (kvrelay.limits.read_bounded_file, as at
start), at each of these: once the operator has written the new token there, the replica's
next heartbeat presents it, without a restart. A token from an environment variable cannot be
re-read by a running process: the refusal says so, and that a restart is the fix.

A swap is one synchronous step on the event loop (`on_swap`), so no call sees half of it: every
place the token is used reads it from here or is given it there. The broker channel asks
`broker_metadata` on each call; the server's interceptor (the broker's call tokens and the AR
write tokens derive from the token) and the registration (`RegisterReplicaRequest.token`) are
given the new credentials by `on_swap`; an AR's ranks hold no token (each PutKv command brings
its bearer, `Credentials.put_kv_bearer`). The server keeps taking what derives from the token
it replaced for `security.rotation_grace_seconds` (kvrelay.server.GrpcServer.replace_credentials):
the broker switches to the new call and write tokens only once it has seen this replica's new
token, and a write token handed out before is still in use.

Owns reading and swapping only; never logs a token or anything derived from one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kvrelay.logging import get_logger
from kvrelay.security import (
    CallerClass,
    Credentials,
    CredentialSource,
    Metadata,
    SecurityError,
    read_replica_token_file,
    replica_token_source,
)

log = get_logger(__name__)

RELOADED: Final = "reloaded"
UNCHANGED: Final = "unchanged"
NOT_RELOADABLE: Final = "not reloadable"


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    """What one re-read of the token file found: `state` is RELOADED (a new token, swapped in),
    UNCHANGED (the token already held), NOT_RELOADABLE (not from a file), or "failed" with
    `error` (the file is missing, not a regular file, too large, not a token: the token held
    stays)."""

    state: str
    error: str = ""

    @property
    def reloaded(self) -> bool:
        return self.state == RELOADED


class ReplicaToken:
    """The credentials of replica `replica_id`, swapped as a whole when its token file changes."""

    def __init__(
        self,
        replica_id: str,
        creds: Credentials,
        source: CredentialSource,
        *,
        on_swap: Callable[[Credentials], None] | None = None,
        read: Callable[[str], str] = read_replica_token_file,
    ) -> None:
        self.replica_id = replica_id
        self.source = source
        self.on_swap = on_swap
        self._creds = creds
        self._read = read
        self._last_error = ""
        self.reloads = 0

    @property
    def current(self) -> Credentials:
        return self._creds

    def broker_metadata(self) -> Metadata:
        """The metadata of this replica's next call to the broker (its token and id)."""
        return self._creds.channel(CallerClass.REPLICA, self.replica_id).metadata()

    def put_kv_bearer(self, write_token: str) -> str:
        """The bearer of one PutKv command (Credentials.put_kv_bearer of the token held now)."""
        return self._creds.put_kv_bearer(write_token)

    async def reload(self) -> ReloadOutcome:
        """Re-read the token file; swap in a token that differs from the one held. Never raises
        for what the file holds: a failure keeps the token held, logged once per distinct cause."""
        if self.source.file is None:
            return ReloadOutcome(NOT_RELOADABLE)
        path = self.source.file
        try:
            token = await asyncio.to_thread(self._read, path)
            self._check_distinct(token)
        except SecurityError as err:
            error = str(err)
            if error != self._last_error:
                self._last_error = error
                log.warning("credential_reload_failed", replica_id=self.replica_id, token_file=path, error=error,
                            consequence="the token held stays; re-read at the broker's next refusal or superseded heartbeat")  # fmt: skip
            return ReloadOutcome("failed", error)
        self._last_error = ""
        held = self._creds.replica_token or ""
        if hmac.compare_digest(token.encode(), held.encode()):
            return ReloadOutcome(UNCHANGED)
        self.swap(dataclasses.replace(self._creds, replica_token=token))
        self.reloads += 1
        log.info("credential_reloaded", replica_id=self.replica_id, token_file=path, reloads=self.reloads,
                 effect="the next heartbeat, registration and call of this replica present the new token; "
                        "its server takes only what derives from it")  # fmt: skip
        return ReloadOutcome(RELOADED)

    def swap(self, creds: Credentials) -> None:
        """Hold `creds` from now on: one step, with `on_swap`, before any other call runs."""
        self._creds = creds
        if self.on_swap is not None:
            self.on_swap(creds)

    def _check_distinct(self, token: str) -> None:
        creds = self._creds
        if token in (creds.api_token, creds.operator_token):
            raise SecurityError(
                f"security.replica_token_file: {self.source.file} holds a token equal to this replica's api or "
                "operator token (each names a caller class): not taken"
            )


def replica_token_for_process(replica_id: str, creds: Credentials, token_file: str | None,
                              token_env: str | None) -> ReplicaToken:  # fmt: skip
    """The ReplicaToken of a replica process as load_credentials resolved it: from `token_file`
    when the config names one (it wins over the environment variable, as at start)."""
    return ReplicaToken(replica_id, creds, replica_token_source(file=token_file, env=None if token_file else token_env))
