"""Reloading the broker's credentials while it runs (`kvrelay rotate-secrets`, an operator RPC).

Re-reads the broker's replica secret (bound mode) or shared replica token, and its api and
operator tokens, from the files the config names (bounded, checked as at start:
kvrelay.security.reload_tokens), and when any changed swaps them all in one step on the event
loop (kvrelay.security.CredentialRotation): from then on the new ones are taken, and the
replaced ones for `security.rotation_grace_seconds` more, so replicas and clients still holding
them keep working; each replica is told at its next heartbeat to re-read its token file
(HeartbeatResponse.credential_superseded). A credential from an environment variable cannot be
re-read by a running process: it is reported `not reloadable` and stays. Nothing is swapped
when any file fails (all or nothing: half a rotation would split who takes what).

Owns reading and deciding only; never logs a token, a secret, or anything derived from one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvrelay.logging import get_logger
from kvrelay.security import (
    BROKER_CALLER_ID,
    CredentialRotation,
    Credentials,
    SecurityError,
    TlsMaterial,
    credential_sources,
    read_tls,
    reload_tokens,
    require_bound_credential,
    tls_files,
)
from kvrelay.server_tls import ServerCertificates, check_server_pair

if TYPE_CHECKING:
    from kvrelay.config import SecurityConfig

log = get_logger(__name__)

RELOADED: Final = "reloaded"
UNCHANGED: Final = "unchanged"
NOT_RELOADABLE: Final = "not reloadable"
FAILED: Final = "failed"
# SourceReload.key of the server's certificate, key and CA files (security.tls).
TLS_KEY: Final = "tls"


@dataclass(frozen=True, slots=True)
class SourceReload:
    """What one reload found for one credential: `key` (`replica_secret`, `replica_token`,
    `api_token`, `operator_token`), where it comes from (`source`, e.g.
    `security.api_token_file (/run/secrets/api)`) and `state`: RELOADED (a new value, taken),
    UNCHANGED, NOT_RELOADABLE (an environment variable), FAILED (nothing was taken)."""

    key: str
    source: str
    state: str


@dataclass(frozen=True, slots=True)
class SecretsReload:
    """The answer of one reload: per source, whether the credentials were swapped (`rotated`),
    for how long the replaced ones are still taken, and why nothing was taken (`error`)."""

    sources: tuple[SourceReload, ...]
    rotated: bool
    grace_seconds: float
    error: str = ""


class BrokerSecrets:
    """The broker's credentials, reloadable from their files (the module docstring)."""

    def __init__(
        self, cfg: SecurityConfig, rotation: CredentialRotation,
        read: Callable[[SecurityConfig, Credentials, str], Credentials] = reload_tokens,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.rotation = rotation
        self._read = read
        # The certificate and key the broker's server presents (security.tls), swapped for the
        # files' new pair once it is checked (kvrelay.server_tls); None: no TLS, or not reloaded.
        self.server_certificates: ServerCertificates | None = None
        # Awaited after a rotation, before the answer: the rotation's record is on disk
        # (broker.credential_grace; broker.main gives the journal's `durable`).
        self.persisted: Callable[[], Awaitable[None]] | None = None
        # reload outcomes since the broker started, by outcome (kvrelay_broker_credential_reloads_total).
        self.outcomes: dict[str, int] = {RELOADED: 0, UNCHANGED: 0, FAILED: 0}

    def _read_tls(self) -> TlsMaterial:
        """The files' TLS material, checked as a pair a client trusting the CA file accepts."""
        tls = read_tls(self.cfg, BROKER_CALLER_ID)
        assert tls is not None  # server_certificates is set only with security.tls
        check_server_pair(tls, tls_files(self.cfg))
        return tls

    async def reload(self) -> SecretsReload:
        """Re-read every credential file; swap in what changed. Never raises for what a file
        holds: the answer says what was taken and what not."""
        held = self.rotation.current
        sources = credential_sources(self.cfg, BROKER_CALLER_ID)
        certificates = self.server_certificates
        try:
            new = await asyncio.to_thread(self._read, self.cfg, held, BROKER_CALLER_ID)
            require_bound_credential(new, BROKER_CALLER_ID)
            tls = None if certificates is None else await asyncio.to_thread(self._read_tls)
        except SecurityError as err:
            self.outcomes[FAILED] += 1
            failed = tuple(
                SourceReload(s.key, s.describe(), FAILED if s.reloadable else NOT_RELOADABLE) for s in sources
            ) + ((SourceReload(TLS_KEY, tls_files(self.cfg), FAILED),) if certificates is not None else ())
            log.warning("credentials_reload_failed", error=str(err),
                        consequence="nothing was taken: the broker takes the credentials it held, as before")  # fmt: skip
            return SecretsReload(failed, rotated=False, grace_seconds=self.rotation.grace_left_s(), error=str(err))
        answers = []
        for s in sources:
            if not s.reloadable:
                answers.append(SourceReload(s.key, s.describe(), NOT_RELOADABLE))
                continue
            changed = not _equal(getattr(held, s.key), getattr(new, s.key))
            answers.append(SourceReload(s.key, s.describe(), RELOADED if changed else UNCHANGED))
        tls_changed = False
        if certificates is not None and tls is not None:
            tls_changed = _tls_changed(certificates.tls, tls)
            answers.append(SourceReload(TLS_KEY, tls_files(self.cfg), RELOADED if tls_changed else UNCHANGED))
            new = dataclasses.replace(new, tls=tls if tls_changed else held.tls)
        tokens_changed = any(a.state == RELOADED for a in answers if a.key != TLS_KEY)
        rotated = tokens_changed or tls_changed
        if tls_changed:
            assert certificates is not None and tls is not None
            certificates.swap(tls)  # new connections from now on; those up keep theirs
        if tls_changed and not tokens_changed:
            self.rotation.replace_current(new)  # the same tokens: no generation replaced
            self.outcomes[RELOADED] += 1
        elif rotated:
            self.rotation.rotate(new)
            self.outcomes[RELOADED] += 1
            if self.persisted is not None:
                await self.persisted()
        else:
            self.outcomes[UNCHANGED] += 1
        not_reloadable = [a.source for a in answers if a.state == NOT_RELOADABLE]
        log.info(
            "credentials_reloaded",
            rotated=rotated,
            reloaded=[a.key for a in answers if a.state == RELOADED],
            not_reloadable=not_reloadable,
            grace_seconds=round(self.rotation.grace_left_s(), 1),
            effect=("the new credentials are taken now, the replaced ones until the grace ends; each replica is "
                    "told to re-read its token file at its next heartbeat") if rotated else "none",
        )  # fmt: skip
        return SecretsReload(tuple(answers), rotated=rotated, grace_seconds=self.rotation.grace_left_s())


def _tls_changed(held: TlsMaterial, new: TlsMaterial) -> bool:
    return not (
        _equal_bytes(held.cert_chain, new.cert_chain)
        and _equal_bytes(held.private_key, new.private_key)
        and _equal_bytes(held.root_certificates, new.root_certificates)
    )


def _equal_bytes(a: bytes | None, b: bytes | None) -> bool:
    return hmac.compare_digest(a or b"", b or b"")


def _equal(a: str | None, b: str | None) -> bool:
    return hmac.compare_digest((a or "").encode(), (b or "").encode())


__all__ = ["BrokerSecrets", "SecretsReload", "SourceReload"]
