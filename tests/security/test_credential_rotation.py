"""Rotating credentials without a restart (docs/operations.md, Rotating the replica secret), in
process: the dual-accept window of kvrelay.security.CredentialRotation (old and new credentials
both taken for security.rotation_grace_seconds, then only the new), what the broker presents to
each replica during it (`held_by`: the broker's call tokens and the AR write tokens derive from
what that replica holds), the replica side's own window after it takes a new token, the broker's
all-or-nothing reload of its files (broker/credential_reload.py) and a replica told it is
superseded (kvrelay.broker_credential). The real processes: test_credential_rotation_procs.py."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.credential_reload import BrokerSecrets
from kvrelay.broker.tickets import Unauthenticated
from kvrelay.broker_credential import BrokerCredentialWatch
from kvrelay.config import SecurityConfig
from kvrelay.replica_token import ReplicaToken
from kvrelay.security import (
    AUTHORIZATION_METADATA,
    BROKER_CALLER_ID,
    MAX_SUPERSEDED_GENERATIONS,
    REPLICA_ID_METADATA,
    AuthInterceptor,
    CallerClass,
    CredentialRotation,
    Credentials,
    Keepalive,
    TlsMaterial,
    broker_call_token,
    load_credentials,
    put_kv_token,
    replica_token_for,
    replica_token_source,
)
from tests.broker.helpers import ManualClock, ar_spec

OLD, NEW = "rotation-old-secret-0123", "rotation-new-secret-4567"
OPERATOR_OLD, OPERATOR_NEW = "operator-old-89ab", "operator-new-cdef"
GRACE = 60.0


def bound_broker(secret: str, operator: str = OPERATOR_OLD) -> Credentials:
    return Credentials(operator_token=operator, bound_replica_tokens=True, replica_secret=secret,
                       rate_limit_per_second=0.0, rotation_grace_s=GRACE)  # fmt: skip


def authenticate(interceptor: AuthInterceptor, token: str, declared: str | None) -> Any:
    metadata = [(AUTHORIZATION_METADATA, f"Bearer {token}")]
    if declared is not None:
        metadata.append((REPLICA_ID_METADATA, declared))
    return interceptor.authenticate(metadata, {})


def rotated_broker(clock: ManualClock) -> tuple[CredentialRotation, AuthInterceptor]:
    rotation = CredentialRotation(bound_broker(OLD), clock=clock)
    interceptor = AuthInterceptor(rotation.current, rotation=rotation)
    rotation.rotate(bound_broker(NEW, OPERATOR_NEW))
    return rotation, interceptor


# ---------------------------------------------------------------- the broker's window


def test_the_broker_takes_old_and_new_replica_tokens_until_the_grace_ends_then_only_the_new() -> None:
    clock = ManualClock()
    rotation, interceptor = rotated_broker(clock)
    old_ar0, new_ar0 = replica_token_for(OLD, "ar-0"), replica_token_for(NEW, "ar-0")

    old = authenticate(interceptor, old_ar0, "ar-0")
    assert CallerClass.REPLICA in old.classes and old.superseded  # taken, and told it is the old one
    new = authenticate(interceptor, new_ar0, "ar-0")
    assert CallerClass.REPLICA in new.classes and not new.superseded
    # Bound still: the old token of ar-0 is not ar-1's, in the window either.
    assert CallerClass.REPLICA not in authenticate(interceptor, old_ar0, "ar-1").classes
    # The operator token rotates the same way.
    assert CallerClass.OPERATOR in authenticate(interceptor, OPERATOR_OLD, None).classes
    assert CallerClass.OPERATOR in authenticate(interceptor, OPERATOR_NEW, None).classes
    assert rotation.grace_left_s() == GRACE

    clock.advance(GRACE - 0.5)
    assert authenticate(interceptor, old_ar0, "ar-0").superseded
    clock.advance(0.5)  # the grace is over
    after = authenticate(interceptor, old_ar0, "ar-0")
    assert not after.classes & {CallerClass.REPLICA, CallerClass.OPERATOR} and not after.authenticated
    assert "not the replica token of 'ar-0'" in after.refusal
    assert not authenticate(interceptor, OPERATOR_OLD, None).authenticated
    assert CallerClass.REPLICA in authenticate(interceptor, new_ar0, "ar-0").classes
    assert rotation.previous() is None and rotation.grace_left_s() == 0.0


def test_without_a_grace_a_rotation_takes_only_the_new_credentials() -> None:
    rotation = CredentialRotation(bound_broker(OLD), clock=ManualClock())
    interceptor = AuthInterceptor(rotation.current, rotation=rotation)
    rotation.rotate(bound_broker(NEW), grace_s=0.0)
    assert not authenticate(interceptor, replica_token_for(OLD, "ar-0"), "ar-0").authenticated


THIRD, FOURTH, FIFTH = "rotation-third-secret-89", "rotation-fourth-secret-ab", "rotation-fifth-secret-cd"


def test_each_replaced_generation_keeps_its_own_grace_across_a_second_rotation() -> None:
    clock = ManualClock()
    rotation, interceptor = rotated_broker(clock)  # OLD -> NEW at t=0: OLD until t=GRACE
    clock.advance(GRACE / 2)
    rotation.rotate(bound_broker(THIRD, OPERATOR_NEW))  # NEW -> THIRD: NEW until t=1.5*GRACE
    old_dit0, new_dit0 = replica_token_for(OLD, "dit-0"), replica_token_for(NEW, "dit-0")

    # A replica still on the token of two rotations ago keeps working until OLD's own deadline.
    two_ago = authenticate(interceptor, old_dit0, "dit-0")
    assert CallerClass.REPLICA in two_ago.classes and two_ago.superseded
    assert rotation.grace_left_s("dit-0") == GRACE / 2  # its own generation's deadline
    assert rotation.broker_channel("dit-0").token == broker_call_token(old_dit0)
    assert rotation.write_token("dit-0", "ar-0") == put_kv_token(old_dit0, "ar-0")
    one_ago = authenticate(interceptor, replica_token_for(NEW, "ar-0"), "ar-0")
    assert CallerClass.REPLICA in one_ago.classes and one_ago.superseded
    assert rotation.grace_left_s("ar-0") == GRACE
    assert rotation.grace_left_s() == GRACE  # until the last replaced generation ends
    assert not authenticate(interceptor, replica_token_for(THIRD, "ar-0"), "ar-0").superseded
    assert rotation.grace_left_s("ar-0") == 0.0  # on the current generation now
    # Not seen since the first rotation: presented the oldest generation still taken.
    assert rotation.broker_channel("ar-1").token == broker_call_token(replica_token_for(OLD, "ar-1"))

    clock.advance(GRACE / 2)  # OLD's grace is over, NEW's is not
    assert not authenticate(interceptor, old_dit0, "dit-0").authenticated
    assert authenticate(interceptor, new_dit0, "dit-0").superseded
    assert rotation.broker_channel("dit-0").token == broker_call_token(new_dit0)
    assert rotation.broker_channel("ar-1").token == broker_call_token(replica_token_for(NEW, "ar-1"))
    assert CallerClass.OPERATOR in authenticate(interceptor, OPERATOR_NEW, None).classes
    assert not authenticate(interceptor, OPERATOR_OLD, None).authenticated
    clock.advance(GRACE / 2)  # NEW's too
    assert not authenticate(interceptor, new_dit0, "dit-0").authenticated
    assert rotation.superseded() == [] and rotation.grace_left_s() == 0.0
    assert rotation.broker_channel("dit-0").token == broker_call_token(replica_token_for(THIRD, "dit-0"))


def test_at_most_max_superseded_generations_are_taken_the_oldest_dropped_first() -> None:
    clock = ManualClock()
    rotation, interceptor = rotated_broker(clock)
    secrets = [OLD, NEW, THIRD, FOURTH, FIFTH]
    for secret in secrets[2:]:
        clock.advance(1.0)
        rotation.rotate(bound_broker(secret, OPERATOR_NEW))
    assert MAX_SUPERSEDED_GENERATIONS == 3
    assert [s.generation for s in rotation.superseded()] == [3, 2, 1] and rotation.generation == 4
    # OLD (generation 0) was dropped before its grace ended; the bound's generations are taken.
    assert not authenticate(interceptor, replica_token_for(OLD, "dit-0"), "dit-0").authenticated
    for secret in secrets[1:4]:
        assert authenticate(interceptor, replica_token_for(secret, "dit-0"), "dit-0").superseded
    assert CallerClass.REPLICA in authenticate(interceptor, replica_token_for(FIFTH, "dit-0"), "dit-0").classes


def test_the_broker_presents_to_each_replica_what_it_holds_until_it_shows_the_new_token() -> None:
    clock = ManualClock()
    rotation, interceptor = rotated_broker(clock)
    old_dit0, new_dit0 = replica_token_for(OLD, "dit-0"), replica_token_for(NEW, "dit-0")

    def call_token(replica_id: str) -> str | None:
        return rotation.broker_channel(replica_id).token

    # Right after the rotation every replica holds its old token: the broker calls it with the
    # call token of that one, and hands ARs write tokens a DiT on its old token takes.
    assert call_token("dit-0") == broker_call_token(old_dit0)
    assert rotation.write_token("dit-0", "ar-0") == put_kv_token(old_dit0, "ar-0")
    authenticate(interceptor, old_dit0, "dit-0")  # a heartbeat on the old token: still old
    assert call_token("dit-0") == broker_call_token(old_dit0)
    authenticate(interceptor, new_dit0, "dit-0")  # it took its new token
    assert call_token("dit-0") == broker_call_token(new_dit0)
    assert rotation.write_token("dit-0", "ar-0") == put_kv_token(new_dit0, "ar-0")
    assert call_token("ar-0") == broker_call_token(replica_token_for(OLD, "ar-0"))  # not yet seen
    # A rejected caller declaring dit-0 changes nothing of it.
    authenticate(interceptor, "not-a-token", "dit-0")
    assert call_token("dit-0") == broker_call_token(new_dit0)
    clock.advance(GRACE)
    assert call_token("ar-0") == broker_call_token(replica_token_for(NEW, "ar-0"))


def test_what_a_replica_holds_is_only_its_generations_tokens_the_tls_material_is_the_current_one() -> None:
    # The broker's certificate and CA reloaded after the token rotation (kvrelay rotate-secrets,
    # its TLS files changed alone: replace_current, no generation). Before, held_by gave the whole
    # Credentials of the replaced generation: dit-0, still on its OLD token, was dialled with the
    # TLS material (and keepalive, limits) of that generation's time, a CA it may no longer trust.
    before = TlsMaterial(b"cert-before", b"key-before", b"ca-before", require_client_cert=True)
    after = TlsMaterial(b"cert-after", b"key-after", b"ca-after", require_client_cert=True)
    clock = ManualClock()
    rotation = CredentialRotation(dataclasses.replace(bound_broker(OLD), tls=before), clock=clock)
    rotation.rotate(dataclasses.replace(bound_broker(NEW, OPERATOR_NEW), tls=before))
    rotation.replace_current(dataclasses.replace(rotation.current, tls=after, keepalive=Keepalive(7.0, 3.0)))

    held = rotation.held_by("dit-0")  # not seen since the rotation: the OLD generation
    assert held.replica_secret == OLD and held.operator_token == OPERATOR_OLD
    assert held.tls is after and held.keepalive == Keepalive(7.0, 3.0)
    assert held == dataclasses.replace(rotation.current, replica_secret=OLD, operator_token=OPERATOR_OLD)
    channel = rotation.broker_channel("dit-0")
    assert channel.tls is after and channel.token == broker_call_token(replica_token_for(OLD, "dit-0"))
    previous = rotation.previous()
    assert previous is not None and previous.replica_secret == OLD and previous.tls is after
    clock.advance(GRACE)
    assert rotation.held_by("dit-0") is rotation.current


def test_shared_mode_rotates_the_shared_token_and_hands_the_token_the_dit_holds_to_the_ar() -> None:
    clock = ManualClock()
    rotation = CredentialRotation(Credentials(replica_token="shared-old-token", rotation_grace_s=GRACE), clock=clock)
    interceptor = AuthInterceptor(rotation.current, rotation=rotation)
    assert rotation.write_token("dit-0", "ar-0") == ""  # no rotation: the AR presents its own
    rotation.rotate(Credentials(replica_token="shared-new-token", rotation_grace_s=GRACE))
    assert rotation.shared_replica_tokens() == ("shared-new-token", "shared-old-token")
    assert authenticate(interceptor, "shared-old-token", "ar-0").superseded
    # The AR may already hold the new token while the DiT holds the old: the broker hands it
    # the one the DiT holds, and the AR presents that one (Credentials.put_kv_bearer).
    assert rotation.write_token("dit-0", "ar-0") == "shared-old-token"
    ar = Credentials(replica_token="shared-new-token")
    assert ar.put_kv_bearer(rotation.write_token("dit-0", "ar-0")) == "shared-old-token"
    assert ar.put_kv_bearer("") == "shared-new-token"
    assert rotation.broker_channel("dit-0").token == "shared-old-token"
    authenticate(interceptor, "shared-new-token", "dit-0")
    assert rotation.write_token("dit-0", "ar-0") == "shared-new-token"
    assert rotation.broker_channel("dit-0").token == "shared-new-token"
    clock.advance(GRACE)
    assert rotation.shared_replica_tokens() == ("shared-new-token",)
    assert not authenticate(interceptor, "shared-old-token", "ar-0").authenticated
    assert rotation.write_token("dit-0", "ar-0") == ""


def test_the_registration_token_of_shared_mode_follows_the_window() -> None:
    clock = ManualClock()
    rotation = CredentialRotation(Credentials(replica_token="shared-old-token", rotation_grace_s=GRACE), clock=clock)
    core = BrokerCore(None, journal_synchronous="OFF", registration_token="shared-old-token")
    try:
        core.registration_tokens = rotation.shared_replica_tokens
        rotation.rotate(Credentials(replica_token="shared-new-token", rotation_grace_s=GRACE))
        core.register_replica(ar_spec("ar-0"), token="shared-old-token")
        core.register_replica(ar_spec("ar-1"), token="shared-new-token")
        clock.advance(GRACE)
        with pytest.raises(Unauthenticated):
            core.register_replica(ar_spec("ar-2"), token="shared-old-token")
        core.register_replica(ar_spec("ar-3"), token="shared-new-token")
    finally:
        core.close()


# ---------------------------------------------------------------- a replica's window


def test_a_replica_that_took_its_new_token_still_takes_the_brokers_old_call_and_write_tokens_for_the_grace() -> None:
    clock = ManualClock()
    old_dit0, new_dit0 = replica_token_for(OLD, "dit-0"), replica_token_for(NEW, "dit-0")
    held = Credentials(replica_token=old_dit0, bound_replica_tokens=True, rotation_grace_s=GRACE)
    rotation = CredentialRotation(held, clock=clock)
    interceptor = AuthInterceptor(held, rotation=rotation)
    rotation.rotate(dataclasses.replace(held, replica_token=new_dit0))  # GrpcServer.replace_credentials

    for token in (broker_call_token(old_dit0), broker_call_token(new_dit0)):
        assert CallerClass.REPLICA in authenticate(interceptor, token, BROKER_CALLER_ID).classes
    for token in (put_kv_token(old_dit0, "ar-0"), put_kv_token(new_dit0, "ar-0")):
        assert CallerClass.REPLICA in authenticate(interceptor, token, "ar-0").classes
    clock.advance(GRACE)
    assert not authenticate(interceptor, broker_call_token(old_dit0), BROKER_CALLER_ID).authenticated
    assert not authenticate(interceptor, put_kv_token(old_dit0, "ar-0"), "ar-0").authenticated
    assert CallerClass.REPLICA in authenticate(interceptor, broker_call_token(new_dit0), BROKER_CALLER_ID).classes


def test_a_superseded_replica_rereads_its_file_and_warns_only_while_it_holds_no_new_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dit-0.token"
    old_dit0, new_dit0 = replica_token_for(OLD, "dit-0"), replica_token_for(NEW, "dit-0")
    path.write_text(old_dit0)
    swapped: list[str | None] = []
    token = ReplicaToken("dit-0", Credentials(replica_token=old_dit0, bound_replica_tokens=True),
                         replica_token_source(file=str(path)), on_swap=lambda c: swapped.append(c.replica_token))  # fmt: skip
    clock = ManualClock()
    watch = BrokerCredentialWatch("dit-0", token=token, clock=clock)

    asyncio.run(watch.superseded(30.0))  # the file still holds the old token: warned, kept
    asyncio.run(watch.superseded(29.0))  # rate limited
    out = capsys.readouterr()
    err = out.out + out.err
    assert err.count("credential_superseded") == 1 and str(path) in err
    assert swapped == []
    path.write_text(new_dit0)
    clock.advance(120.0)  # past the rate limit: a warning now would be about the new token
    asyncio.run(watch.superseded(28.0))
    assert swapped == [new_dit0] and token.current.replica_token == new_dit0
    out = capsys.readouterr()
    assert "credential_superseded" not in out.out + out.err and "credential_reloaded" in out.out + out.err
    assert not watch.refused  # never shown refused


# ---------------------------------------------------------------- the broker's reload


def _files(tmp_path: Path, secret: str, operator: str) -> SecurityConfig:
    (tmp_path / "secret").write_text(secret + "\n")
    (tmp_path / "operator").write_text(operator + "\n")
    return SecurityConfig(replica_tokens="bound", replica_secret_file=str(tmp_path / "secret"),
                          operator_token_file=str(tmp_path / "operator"), api_token_env="KVRELAY_TEST_ROT_API",
                          rotation_grace_seconds=GRACE)  # fmt: skip


def test_the_broker_reload_takes_changed_files_reports_env_sources_and_takes_nothing_when_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRELAY_TEST_ROT_API", "api-token-from-env")
    cfg = _files(tmp_path, OLD, OPERATOR_OLD)
    clock = ManualClock()
    rotation = CredentialRotation(load_credentials(cfg), clock=clock)
    secrets = BrokerSecrets(cfg, rotation)

    same = asyncio.run(secrets.reload())
    assert not same.rotated and not same.error and rotation.rotations == 0
    assert {s.key: s.state for s in same.sources} == {
        "replica_secret": "unchanged", "operator_token": "unchanged", "api_token": "not reloadable"}  # fmt: skip
    assert "$KVRELAY_TEST_ROT_API" in next(s.source for s in same.sources if s.key == "api_token")

    (tmp_path / "secret").write_text(NEW)
    answer = asyncio.run(secrets.reload())
    assert answer.rotated and answer.grace_seconds == GRACE and not answer.error
    assert {s.key: s.state for s in answer.sources}["replica_secret"] == "reloaded"
    assert {s.key: s.state for s in answer.sources}["operator_token"] == "unchanged"
    assert rotation.current.replica_secret == NEW and rotation.current.api_token == "api-token-from-env"
    assert rotation.previous() is not None and rotation.previous().replica_secret == OLD  # type: ignore[union-attr]

    # One file that is no token: nothing taken, the other file's new value neither.
    (tmp_path / "secret").write_text("rotation-fourth-secret")
    (tmp_path / "operator").write_bytes(b"\xff\xfe")
    failed = asyncio.run(secrets.reload())
    assert failed.error and not failed.rotated and "security.operator_token_file" in failed.error
    assert rotation.current.replica_secret == NEW and rotation.rotations == 1
    assert secrets.outcomes == {"reloaded": 1, "unchanged": 1, "failed": 1}
    (tmp_path / "operator").write_text(OLD)  # equal to the old secret is fine; to the new one not
    (tmp_path / "secret").write_text(OLD)
    assert "must differ" in asyncio.run(secrets.reload()).error
