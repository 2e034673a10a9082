"""A credential rotation's grace across a broker restart, in process (broker/credential_grace.py):
the replaced generations are journaled sealed under the broker's current credentials, taken back
by a broker that starts within their grace (each its own deadline), never in plaintext on disk,
and dropped when the broker starts with other credentials or the record is damaged. The real
process (kill -9 within the grace): test_credential_grace_restart_procs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.broker.credential_grace import META_KEY, CredentialGraceStore
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


def test_the_journal_holds_no_replaced_credential_in_plaintext(tmp_path: Path) -> None:
    wall = ManualClock(start=1_800_000_000.0)
    path = tmp_path / "broker.sqlite"
    broker = Broker(path, bound(S0, OPERATOR_OLD), wall)
    broker.rotation.rotate(bound(S1, OPERATOR_NEW))
    record = broker.journal.meta_value(META_KEY)
    assert record is not None and len(json.loads(record)["superseded"]) == 1
    broker.journal.close()
    on_disk = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("broker.sqlite"))
    assert b"superseded" in on_disk  # the record is there
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
    # A record whose tag does not match: its deadline moved (a longer grace) after sealing.
    assert record is not None
    damaged = json.loads(record)
    damaged["superseded"][0]["deadline"] += 3600.0
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
