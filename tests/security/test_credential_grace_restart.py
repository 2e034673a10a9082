"""A credential rotation's grace across a broker restart, in process (broker/credential_grace.py):
the replaced generations are journaled sealed under the broker's current credentials, taken back
by a broker that starts within their grace (each its own deadline), never in plaintext on disk,
and dropped when the broker starts with other credentials or the record is damaged. The real
process (kill -9 within the grace): test_credential_grace_restart_procs.py."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from structlog.testing import capture_logs

from kvrelay.broker.credential_grace import (
    META_KEY,
    CredentialGraceStore,
    SealError,
    hkdf_sha256,
    open_record,
    seal_keys,
    seal_record,
)
from kvrelay.broker.journal import Journal
from kvrelay.security import (
    AuthInterceptor,
    CallerClass,
    CredentialRotation,
    Credentials,
    broker_call_token,
    replica_token_for,
)
from tests.broker.helpers import ManualClock
from tests.security.test_credential_rotation import OPERATOR_NEW, OPERATOR_OLD, authenticate

GRACE = 60.0
S0, S1, S2 = "grace-restart-secret-zero-01", "grace-restart-secret-one-23", "grace-restart-secret-two-45"


def bound(secret: str, operator: str) -> Credentials:
    return Credentials(operator_token=operator, bound_replica_tokens=True, replica_secret=secret,
                       rotation_grace_s=GRACE)  # fmt: skip


class Broker:
    """One broker 'process': its journal, rotation and store, on a shared wall clock."""

    def __init__(self, path: Path, creds: Credentials, wall: ManualClock) -> None:
        self.journal = Journal(path)
        # Each process has its own monotonic clock, unrelated to the last one's.
        self.clock = ManualClock(start=wall.now * 7 + 123.0)
        self.wall = wall
        self.rotation = CredentialRotation(creds, clock=self.clock)
        self.store = CredentialGraceStore(self.journal, self.rotation, wall=wall)
        self.restored = self.store.restore()
        self.rotation.on_change = self.store.save_quietly
        self.interceptor = AuthInterceptor(creds, rotation=self.rotation)

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.wall.advance(seconds)

    def takes(self, token: str, replica_id: str) -> bool:
        return CallerClass.REPLICA in authenticate(self.interceptor, token, replica_id).classes


def test_a_restarted_broker_takes_each_replaced_generation_until_its_own_grace_ends(tmp_path: Path) -> None:
    wall = ManualClock(start=1_800_000_000.0)
    path = tmp_path / "broker.sqlite"
    first = Broker(path, bound(S0, OPERATOR_OLD), wall)
    assert first.restored == 0
    first.rotation.rotate(bound(S1, OPERATOR_NEW))  # S0 until wall+60
    first.advance(20.0)
    first.rotation.rotate(bound(S2, OPERATOR_NEW))  # S1 until wall+80
    first.journal.close()  # what kill -9 leaves: every commit was on disk when it returned

    wall.advance(5.0)  # the restart takes a while
    second = Broker(path, bound(S2, OPERATOR_NEW), wall)
    assert second.restored == 2 and second.rotation.generation == 2
    assert second.takes(replica_token_for(S0, "ar-0"), "ar-0")  # two rotations ago
    assert second.takes(replica_token_for(S1, "dit-0"), "dit-0")
    assert CallerClass.OPERATOR in authenticate(second.interceptor, OPERATOR_OLD, None).classes
    assert second.rotation.grace_left_s("ar-0") == pytest.approx(35.0)  # its own deadline, wall-clock
    # The broker presents to dit-0 what it showed: the call token of its S1 token.
    assert second.rotation.broker_channel("dit-0").token == broker_call_token(replica_token_for(S1, "dit-0"))

    second.advance(35.0)  # S0's grace is over
    assert not second.takes(replica_token_for(S0, "ar-0"), "ar-0")
    assert second.takes(replica_token_for(S1, "ar-0"), "ar-0")
    second.journal.close()

    third = Broker(path, bound(S2, OPERATOR_NEW), wall)  # the expiry was recorded
    assert third.restored == 1 and not third.takes(replica_token_for(S0, "ar-0"), "ar-0")
    third.advance(20.0)  # S1's too
    assert not third.takes(replica_token_for(S1, "ar-0"), "ar-0")
    assert third.journal.meta_value(META_KEY) is None  # nothing replaced is taken: no record
    assert third.takes(replica_token_for(S2, "ar-0"), "ar-0")
    third.journal.close()


def test_a_restored_grace_is_never_longer_than_the_grace_configured_at_start(tmp_path: Path) -> None:
    wall = ManualClock(start=1_800_000_000.0)
    path = tmp_path / "broker.sqlite"
    first = Broker(path, bound(S0, OPERATOR_OLD), wall)
    first.rotation.rotate(bound(S1, OPERATOR_NEW))  # S0 until wall+60
    first.journal.close()

    # The host came back with its clock an hour behind: before, S0 was taken for 3660 s more.
    wall.advance(-3600.0)
    second = Broker(path, bound(S1, OPERATOR_NEW), wall)
    assert second.restored == 1 and second.rotation.grace_left_s() == pytest.approx(GRACE)
    second.journal.close()

    # The operator lowered security.rotation_grace_seconds to 10 and restarted the broker.
    third = Broker(path, dataclasses.replace(bound(S1, OPERATOR_NEW), rotation_grace_s=10.0), wall)
    assert third.restored == 1 and third.rotation.grace_left_s() == pytest.approx(10.0)
    assert third.takes(replica_token_for(S0, "ar-0"), "ar-0")
    third.advance(10.0)
    assert not third.takes(replica_token_for(S0, "ar-0"), "ar-0")
    third.journal.close()


def test_the_journal_holds_no_replaced_credential_in_plaintext(tmp_path: Path) -> None:
    wall = ManualClock(start=1_800_000_000.0)
    path = tmp_path / "broker.sqlite"
    broker = Broker(path, bound(S0, OPERATOR_OLD), wall)
    broker.rotation.rotate(bound(S1, OPERATOR_NEW))
    record = broker.journal.meta_value(META_KEY)
    keys = seal_keys(broker.rotation.current)
    assert record is not None and keys is not None
    assert len(open_record(keys, json.loads(record))[1]["superseded"]) == 1
    broker.journal.close()
    on_disk = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("broker.sqlite"))
    assert json.loads(record)["tag"].encode() in on_disk  # the record is there
    for value in (S0, S1, OPERATOR_OLD, OPERATOR_NEW, replica_token_for(S0, "ar-0")):
        assert value.encode() not in on_disk and value.encode().hex().encode() not in on_disk


def test_a_broker_started_with_other_credentials_or_a_damaged_record_takes_only_what_it_read(
    tmp_path: Path,
) -> None:
    wall = ManualClock(start=1_800_000_000.0)
    path = tmp_path / "broker.sqlite"
    first = Broker(path, bound(S0, OPERATOR_OLD), wall)
    first.rotation.rotate(bound(S1, OPERATOR_NEW))
    record = first.journal.meta_value(META_KEY)
    first.journal.close()

    # The secret file was rotated again while the broker was down: the record cannot be opened.
    other = Broker(path, bound(S2, OPERATOR_NEW), wall)
    assert other.restored == 0 and not other.takes(replica_token_for(S0, "ar-0"), "ar-0")
    assert other.journal.meta_value(META_KEY) is None
    # A record whose sealed bytes changed (one bit: a longer deadline, another token).
    assert record is not None
    damaged = json.loads(record)
    sealed = bytearray.fromhex(damaged["sealed"])
    sealed[len(sealed) // 2] ^= 0x01
    damaged["sealed"] = sealed.hex()
    other.journal.commit(meta={META_KEY: json.dumps(damaged)})
    other.journal.close()
    again = Broker(path, bound(S1, OPERATOR_NEW), wall)
    assert again.restored == 0 and not again.takes(replica_token_for(S0, "ar-0"), "ar-0")
    again.journal.commit(meta={META_KEY: record})  # the intact record opens under S1
    again.journal.close()
    last = Broker(path, bound(S1, OPERATOR_NEW), wall)
    assert last.restored == 1 and last.takes(replica_token_for(S0, "ar-0"), "ar-0")
    last.journal.close()


def test_shared_mode_a_restarted_broker_takes_and_hands_out_the_replaced_shared_token(tmp_path: Path) -> None:
    wall = ManualClock(start=1_800_000_000.0)
    path = tmp_path / "broker.sqlite"
    old = Credentials(replica_token="grace-shared-old-token", operator_token=OPERATOR_OLD, rotation_grace_s=GRACE)
    new = Credentials(replica_token="grace-shared-new-token", operator_token=OPERATOR_OLD, rotation_grace_s=GRACE)
    first = Broker(path, old, wall)
    first.rotation.rotate(new)
    first.journal.close()

    second = Broker(path, new, wall)
    assert second.restored == 1
    # RegisterReplicaRequest.token (kvrelay.broker.core.registration_tokens) and the interceptor.
    assert second.rotation.shared_replica_tokens() == ("grace-shared-new-token", "grace-shared-old-token")
    assert authenticate(second.interceptor, "grace-shared-old-token", "dit-0").superseded
    # The DiT is on the old token: the AR is handed it as the PutKv bearer, the DiT called with it.
    assert second.rotation.write_token("dit-0", "ar-0") == "grace-shared-old-token"
    assert second.rotation.broker_channel("dit-0").token == "grace-shared-old-token"
    second.advance(GRACE)
    assert second.rotation.shared_replica_tokens() == ("grace-shared-new-token",)
    assert not authenticate(second.interceptor, "grace-shared-old-token", "dit-0").authenticated
    second.journal.close()


# ---------------------------------------------------------------- the sealing (format 2)


def test_hkdf_is_rfc_5869() -> None:
    # RFC 5869, A.1 (SHA-256, basic) and A.3 (no salt, no info); and the `cryptography` package's.
    ikm = bytes.fromhex("0b" * 22)
    okm = hkdf_sha256(ikm, salt=bytes.fromhex("000102030405060708090a0b0c"), info=bytes.fromhex("f0f1f2f3f4f5f6f7f8f9"),
                      length=42)  # fmt: skip
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")
    assert hkdf_sha256(ikm, salt=b"", info=b"", length=42).hex() == (
        "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8")
    for length in (1, 32, 33, 100):
        salt, info = secrets.token_bytes(16), secrets.token_bytes(9)
        assert hkdf_sha256(ikm, salt=salt, info=info, length=length) == HKDF(
            hashes.SHA256(), length, salt, info).derive(ikm)


def test_the_keys_are_one_per_purpose_and_per_credential_set() -> None:
    keys = seal_keys(bound(S0, OPERATOR_OLD))
    assert keys is not None and len(keys.encrypt) == len(keys.mac) == 32 and keys.encrypt != keys.mac
    assert seal_keys(bound(S0, OPERATOR_OLD)) == keys
    # Any field changes both keys; and the fields are framed: moving a character between two
    # fields is another set of credentials, other keys.
    assert seal_keys(bound(S1, OPERATOR_OLD)) != keys and seal_keys(bound(S0, OPERATOR_NEW)) != keys
    a = seal_keys(Credentials(api_token="api-ab", operator_token="cd-operator"))
    b = seal_keys(Credentials(api_token="api-a", operator_token="bcd-operator"))
    assert a is not None and b is not None and a.encrypt != b.encrypt and a.mac != b.mac
    assert seal_keys(Credentials()) is None
    assert "encrypt=" not in repr(keys) and keys.encrypt.hex() not in repr(keys)


def test_every_part_of_the_record_is_authenticated_its_generation_included() -> None:
    keys = seal_keys(bound(S1, OPERATOR_NEW))
    assert keys is not None
    payload: dict[str, Any] = {"superseded": [{"generation": 0, "deadline": 1.5e9, "replica_secret": S0}]}
    record = seal_record(keys, 1, payload)
    assert open_record(keys, record) == (1, payload)
    assert S0.encode().hex() not in json.dumps(record) and S0 not in json.dumps(record)
    other = seal_record(keys, 1, payload)
    assert other["nonce"] != record["nonce"] and other["sealed"] != record["sealed"]  # a fresh nonce each time

    def refused(**changes: Any) -> None:
        with pytest.raises(SealError):
            open_record(keys, {**record, **changes})

    # Format 1 took a record renumbered (its own generation bore no tag): no longer.
    refused(generation=2)
    refused(generation=0)
    flipped = bytearray.fromhex(record["nonce"])
    flipped[0] ^= 0x80
    refused(nonce=flipped.hex())
    refused(sealed=record["sealed"][:-2])  # truncated
    refused(sealed=other["sealed"])  # another record's bytes under this one's nonce and tag
    refused(tag=record["tag"][:32])  # a truncated tag is no tag
    refused(tag=other["tag"])
    refused(tag="zz")
    # Another record sealed at another generation does not open as this one's either.
    later = seal_record(keys, 2, payload)
    refused(nonce=later["nonce"], sealed=later["sealed"], tag=later["tag"])
    assert open_record(keys, later)[0] == 2
    wrong = seal_keys(bound(S2, OPERATOR_NEW))
    assert wrong is not None
    with pytest.raises(SealError):
        open_record(wrong, record)


# ---------------------------------------------------------------- format 1, read once


def _seal_v1(creds: Credentials, generation: int, deadline: float, old: Credentials) -> dict[str, Any]:
    """One entry as the broker before format 2 sealed it (its code, copied)."""
    fields = ("api_token", "replica_token", "operator_token", "replica_secret")
    label = b"kvrelay.v1.credential-grace."
    material = b"\x00".join((getattr(creds, f) or "").encode() for f in fields)
    key = hmac.new(material, label + b"key", hashlib.sha256).digest()
    enc = hmac.new(key, label + b"encrypt", hashlib.sha256).digest()
    mac = hmac.new(key, label + b"mac", hashlib.sha256).digest()
    plain = json.dumps({f: getattr(old, f) for f in fields}).encode()
    nonce = secrets.token_bytes(16)
    stream = b"".join(hmac.new(enc, nonce + i.to_bytes(8, "big"), hashlib.sha256).digest()
                      for i in range(len(plain) // 32 + 1))  # fmt: skip
    sealed = bytes(a ^ b for a, b in zip(plain, stream, strict=False))
    header = f"{generation}\x00{deadline!r}\x00".encode()
    tag = hmac.new(mac, nonce + header + sealed, hashlib.sha256).hexdigest()
    return {"generation": generation, "deadline": deadline, "nonce": nonce.hex(), "sealed": sealed.hex(), "tag": tag}


def test_a_format_1_record_is_read_once_and_sealed_again_in_format_2(tmp_path: Path) -> None:
    wall = ManualClock(start=1_800_000_000.0)
    path = tmp_path / "broker.sqlite"
    journal = Journal(path)
    current = bound(S2, OPERATOR_NEW)
    v1 = {"version": 1, "generation": 2, "superseded": [
        _seal_v1(current, 1, wall.now + 40.0, bound(S1, OPERATOR_NEW)),
        _seal_v1(current, 0, wall.now + 20.0, bound(S0, OPERATOR_OLD)),
    ]}  # fmt: skip
    journal.commit(meta={META_KEY: json.dumps(v1)})
    journal.close()

    with capture_logs() as logs:
        broker = Broker(path, current, wall)  # an upgraded broker, within the grace
    assert broker.restored == 2 and broker.rotation.generation == 2
    assert broker.takes(replica_token_for(S0, "ar-0"), "ar-0") and broker.takes(replica_token_for(S1, "ar-1"), "ar-1")
    assert [e["event"] for e in logs if e["event"].startswith("credential_grace")] == [
        "credential_grace_restored", "credential_grace_upgraded"]  # fmt: skip
    text = broker.journal.meta_value(META_KEY)
    assert text is not None
    record = json.loads(text)
    assert record["version"] == 2 and "superseded" not in record  # sealed again, whole
    keys = seal_keys(current)
    assert keys is not None
    generation, payload = open_record(keys, record)
    assert generation == 2 and sorted(e["generation"] for e in payload["superseded"]) == [0, 1]
    broker.journal.close()
    again = Broker(path, current, wall)  # the next start reads format 2
    assert again.restored == 2
    again.journal.close()


def test_a_format_1_record_with_a_damaged_entry_or_renumbered_is_dropped(tmp_path: Path) -> None:
    wall = ManualClock(start=1_800_000_000.0)
    current = bound(S1, OPERATOR_NEW)
    entry = _seal_v1(current, 0, wall.now + 40.0, bound(S0, OPERATOR_OLD))
    for n, record in enumerate([
        {"version": 1, "generation": 1, "superseded": [{**entry, "deadline": entry["deadline"] + 3600.0}]},
        {"version": 1, "generation": 0, "superseded": [entry]},  # not above its entry's generation
        {"version": 1, "generation": 1, "superseded": [entry, entry]},  # one generation twice
        {"version": 7, "generation": 1, "superseded": [entry]},
    ]):  # fmt: skip
        path = tmp_path / f"broker-{n}.sqlite"
        journal = Journal(path)
        journal.commit(meta={META_KEY: json.dumps(record)})
        journal.close()
        with capture_logs() as logs:
            broker = Broker(path, current, wall)
        assert broker.restored == 0 and not broker.takes(replica_token_for(S0, "ar-0"), "ar-0"), record
        assert any(e["event"] == "credential_grace_not_restored" for e in logs)
        assert broker.journal.meta_value(META_KEY) is None
        broker.journal.close()
