"""A replica re-reads its token file when the broker refuses its credential (kvrelay.replica_token;
docs/operations.md, Rotating the replica secret): a new token there is swapped in whole (the
broker channel's next call, the server's checks, the registration), before any refusal is shown;
a file that is no token keeps the token held and says why, once per cause; a token from an
environment variable cannot be re-read, and the refusal says that a restart is the fix. The real
processes: tests/security/test_token_reload_procs.py."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from kvrelay.broker_credential import BrokerCredentialWatch
from kvrelay.errors import KvRelayServerError, to_status
from kvrelay.limits import MAX_SECRET_FILE_BYTES
from kvrelay.replica_token import NOT_RELOADABLE, RELOADED, UNCHANGED, ReplicaToken
from kvrelay.security import AUTHORIZATION_METADATA, Credentials, replica_token_for, replica_token_source

OLD, NEW = (replica_token_for(s, "dit-0") for s in ("old-secret-0123456789", "new-secret-9876543210"))
OPERATOR = "operator-token-0123"


def _creds(token: str, *, bound: bool = True) -> Credentials:
    return Credentials(api_token="api-token-0123", operator_token=OPERATOR, replica_token=token,
                       bound_replica_tokens=bound)  # fmt: skip


def _token_file(tmp_path: Path, text: str = OLD) -> Path:
    path = tmp_path / "dit-0.token"
    path.write_text(text + "\n")
    return path


def _refusal() -> grpc.aio.AioRpcError:
    status = to_status(KvRelayServerError(grpc.StatusCode.UNAUTHENTICATED, "REPLICA_TOKEN_MISMATCH", "not dit-0's"))
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(),
                                grpc.aio.Metadata(*status.trailing_metadata), status.details)  # fmt: skip


def _bearer(token: ReplicaToken) -> str:
    return dict(token.broker_metadata())[AUTHORIZATION_METADATA]


def test_a_new_token_in_the_file_is_swapped_in_whole_and_an_unchanged_one_is_not(tmp_path: Path) -> None:
    path = _token_file(tmp_path)
    swaps: list[Credentials] = []
    token = ReplicaToken("dit-0", _creds(OLD), replica_token_source(file=str(path)), on_swap=swaps.append)
    with capture_logs() as logs:
        assert asyncio.run(token.reload()).state == UNCHANGED
        assert swaps == [] and _bearer(token) == f"Bearer {OLD}"
        path.write_text(NEW)
        assert asyncio.run(token.reload()).state == RELOADED
    # One swap: the replica token alone changes; what the server checks and the broker channel
    # presents derive from it.
    assert [s.replica_token for s in swaps] == [NEW] and token.current is swaps[0]
    assert swaps[0] == _creds(NEW)
    assert _bearer(token) == f"Bearer {NEW}"
    assert [e["event"] for e in logs] == ["credential_reloaded"]
    assert OLD not in str(logs) and NEW not in str(logs)
    assert asyncio.run(token.reload()).state == UNCHANGED and len(swaps) == 1


def _garbage(path: Path) -> None:
    path.write_bytes(b"\xff\xfe\x00 not text")


def _control_characters(path: Path) -> None:
    path.write_text("abc\x07def")


def _empty(path: Path) -> None:
    path.write_text("\n")


def _deleted(path: Path) -> None:
    path.unlink()


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _oversized(path: Path) -> None:
    path.write_text("a" * (MAX_SECRET_FILE_BYTES + 1))


def _operator_token(path: Path) -> None:
    path.write_text(OPERATOR)


@pytest.mark.parametrize(
    ("breaks", "why"),
    [(_garbage, "not UTF-8"), (_control_characters, "printable ASCII"), (_empty, "is empty"),
     (_deleted, "cannot read"), (_fifo, "not a regular file"), (_folder, "a folder"),
     (_oversized, "more than a file holding the token may be"), (_operator_token, "operator token")],
)  # fmt: skip
def test_a_token_file_that_holds_no_token_keeps_the_token_held_and_says_why_once(
    tmp_path: Path, breaks: Callable[[Path], None], why: str
) -> None:
    path = _token_file(tmp_path)
    swaps: list[Credentials] = []
    token = ReplicaToken("dit-0", _creds(OLD), replica_token_source(file=str(path)), on_swap=swaps.append)
    breaks(path)
    with capture_logs() as logs:
        first = asyncio.run(token.reload())
        again = asyncio.run(token.reload())
    assert first.state == again.state == "failed" and why in first.error and str(path) in first.error
    assert swaps == [] and token.current.replica_token == OLD
    # Once per cause: a replica refused every heartbeat does not log it every heartbeat.
    failed = [e for e in logs if e["event"] == "credential_reload_failed"]
    assert len(failed) == 1 and why in failed[0]["error"], logs
    assert OLD not in str(logs) and OPERATOR not in str(logs)


def test_a_refusal_takes_a_new_token_from_the_file_before_it_shows_a_refusal(tmp_path: Path) -> None:
    async def body() -> None:
        path = _token_file(tmp_path)
        changes: list[bool] = []

        async def on_change(refused: bool) -> None:
            changes.append(refused)

        token = ReplicaToken("dit-0", _creds(OLD), replica_token_source(file=str(path), env="KVRELAY_REPLICA_TOKEN"))
        watch = BrokerCredentialWatch("dit-0", on_change=on_change, token=token)
        # The operator wrote the new token before the broker restarted: taken at the first
        # refusal, and the replica never turns NOT_SERVING for it.
        path.write_text(NEW)
        with capture_logs() as logs:
            assert await watch.answered("Heartbeat", _refusal())
        assert not watch.refused and changes == [] and token.current.replica_token == NEW
        assert [e["event"] for e in logs] == ["credential_reloaded"]
        # Refused with the token the file holds: shown, with where the token comes from and what to do.
        with capture_logs() as logs:
            assert await watch.answered("Heartbeat", _refusal())
        assert watch.refused and changes == [True]
        (line,) = [e for e in logs if e["event"] == "broker_refuses_credential"]
        assert line["token_source"] == f"security.replica_token_file ({path})" and line["token_file"] == UNCHANGED
        assert str(path) in line["fix"] and "without a restart" in line["fix"] and "kvrelay token dit-0" in line["fix"]
        assert NEW not in str(logs)

    asyncio.run(body())


def test_a_token_from_the_environment_cannot_be_reloaded_and_the_refusal_says_to_restart() -> None:
    async def body() -> None:
        token = ReplicaToken("dit-0", _creds(OLD), replica_token_source(env="KVRELAY_REPLICA_TOKEN"))
        assert (await token.reload()).state == NOT_RELOADABLE
        watch = BrokerCredentialWatch("dit-0", token=token)
        with capture_logs() as logs:
            assert await watch.answered("Heartbeat", _refusal())
        (line,) = [e for e in logs if e["event"] == "broker_refuses_credential"]
        assert line["token_source"] == "security.replica_token_env ($KVRELAY_REPLICA_TOKEN)"
        assert line["token_file"] == NOT_RELOADABLE
        assert "$KVRELAY_REPLICA_TOKEN" in line["fix"] and "cannot re-read" in line["fix"]
        assert "restart it" in line["fix"] and "kvrelay token dit-0" in line["fix"]

    asyncio.run(body())


def test_an_ars_putkv_bearer_is_the_token_it_holds_now_in_shared_mode_and_never_its_own_in_bound(
    tmp_path: Path,
) -> None:
    path = _token_file(tmp_path, "shared-old")
    shared = ReplicaToken("ar-0", _creds("shared-old", bound=False), replica_token_source(file=str(path)))
    assert shared.put_kv_bearer("") == "shared-old"
    path.write_text("shared-new")
    assert asyncio.run(shared.reload()).reloaded
    # The ranks hold no token of their own: the next write command carries the new one.
    assert shared.put_kv_bearer("") == "shared-new"
    assert shared.current.put_kv_channel("ar-0").token is None
    bound = ReplicaToken("ar-0", _creds(OLD), replica_token_source(file=str(path)))
    assert bound.put_kv_bearer("the-brokers-write-token") == "the-brokers-write-token"
    assert bound.put_kv_bearer("") == ""  # its own token would let the DiT act as this AR
