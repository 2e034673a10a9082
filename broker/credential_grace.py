"""A credential rotation's grace across a broker restart: the replaced generations, sealed.

`kvrelay rotate-secrets` makes the broker take the credentials it replaced for
`security.rotation_grace_seconds` more (kvrelay.security.CredentialRotation). A broker restarted
within that grace (a crash, kill -9, a node reboot) must still take them, or every replica still
on its old token is refused until it has the new one. So every change of what is taken (a
rotation, a generation's grace ending) is recorded in the broker's journal (its `meta` table,
key `credential_grace`: the same SQLite file, directory and permissions as the rest of the
broker's state), and a broker that starts takes back what is still within its grace.

What is recorded holds no credential in plaintext. The broker must present a replaced
generation's material, not only check it (its calls to a replica still on an old token carry
the call token derived from that token; in shared mode it hands an AR the DiT's old token as
the PutKv bearer), so a digest would not do: each generation's tokens and secret are sealed
under a key derived from the broker's current credentials (HMAC-SHA256 keystream over a
random nonce, then an HMAC-SHA256 tag over the nonce, the generation, its deadline and the
sealed bytes: encrypt-then-MAC, stdlib only). Whoever reads the journal alone learns nothing;
whoever also holds the broker's current credential files can already act as anyone. A broker
that starts with other credentials than those it sealed under (files rotated while it was
down) cannot open the record: it is dropped and logged (`credential_grace_not_restored`), and
the broker takes only what it reads, as before this record existed. Deadlines are wall-clock
seconds (the rotation's clock is monotonic and starts again with the process).

Owns the record only; never logs a token, a secret, or anything derived from one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from typing import Any, Final

from kvrelay.broker.journal import Journal, JournalWriteError
from kvrelay.logging import get_logger
from kvrelay.security import CredentialRotation, Credentials, SupersededCredentials

log = get_logger(__name__)

# The journal's meta key of the record.
META_KEY: Final = "credential_grace"
_VERSION: Final = 1
_FIELDS: Final = ("api_token", "replica_token", "operator_token", "replica_secret")
_LABEL: Final = b"kvrelay.v1.credential-grace."
_NONCE_BYTES: Final = 16


class SealError(ValueError):
    """A sealed generation cannot be opened: other credentials, or a damaged record."""


def _key(creds: Credentials) -> bytes | None:
    """The sealing key of the broker holding `creds` (None: it holds no credential)."""
    values = [getattr(creds, f) or "" for f in _FIELDS]
    if not any(values):
        return None
    material = b"\x00".join(v.encode() for v in values)
    return hmac.new(material, _LABEL + b"key", hashlib.sha256).digest()


def _subkey(key: bytes, label: bytes) -> bytes:
    return hmac.new(key, _LABEL + label, hashlib.sha256).digest()


def _keystream(key: bytes, nonce: bytes, length: int) -> bytes:
    enc = _subkey(key, b"encrypt")
    out = bytearray()
    counter = 0
    while len(out) < length:
        out += hmac.new(enc, nonce + counter.to_bytes(8, "big"), hashlib.sha256).digest()
        counter += 1
    return bytes(out[:length])


def _tag(key: bytes, nonce: bytes, generation: int, deadline: float, sealed: bytes) -> str:
    header = f"{generation}\x00{deadline!r}\x00".encode()
    return hmac.new(_subkey(key, b"mac"), nonce + header + sealed, hashlib.sha256).hexdigest()


def seal(key: bytes, gen: SupersededCredentials, deadline: float) -> dict[str, Any]:
    """`gen`'s tokens and secret, sealed under `key`, with its wall-clock `deadline`."""
    plain = json.dumps({f: getattr(gen.creds, f) for f in _FIELDS}).encode()
    nonce = secrets.token_bytes(_NONCE_BYTES)
    sealed = bytes(a ^ b for a, b in zip(plain, _keystream(key, nonce, len(plain)), strict=True))
    return {
        "generation": gen.generation,
        "deadline": deadline,
        "nonce": nonce.hex(),
        "sealed": sealed.hex(),
        "tag": _tag(key, nonce, gen.generation, deadline, sealed),
    }


def unseal(key: bytes, entry: dict[str, Any]) -> tuple[int, float, dict[str, str | None]]:
    """(generation, wall-clock deadline, the tokens and secret) of one sealed entry."""
    try:
        generation, deadline = int(entry["generation"]), float(entry["deadline"])
        nonce, sealed = bytes.fromhex(entry["nonce"]), bytes.fromhex(entry["sealed"])
        tag = str(entry["tag"])
    except (KeyError, TypeError, ValueError) as err:
        raise SealError(f"a damaged entry ({type(err).__name__})") from None
    if not hmac.compare_digest(tag.encode(), _tag(key, nonce, generation, deadline, sealed).encode()):
        raise SealError("sealed under other credentials than the broker holds now, or damaged")
    plain = bytes(a ^ b for a, b in zip(sealed, _keystream(key, nonce, len(sealed)), strict=True))
    values = json.loads(plain)
    return generation, deadline, {f: values.get(f) for f in _FIELDS}


class CredentialGraceStore:
    """Records `rotation`'s replaced generations in `journal` at each change, and takes them
    back at start (the module docstring). `wall` is the wall clock (seconds since the epoch)."""

    def __init__(self, journal: Journal, rotation: CredentialRotation, *,
                 wall: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.journal = journal
        self.rotation = rotation
        self._wall = wall

    def record(self) -> dict[str, Any] | None:
        """The record of what `rotation` takes now (None: no replaced generation is taken)."""
        live = self.rotation.superseded()
        key = _key(self.rotation.current)
        if not live or key is None:
            return None
        offset = self._wall() - self.rotation.now()
        return {
            "version": _VERSION,
            "generation": self.rotation.generation,
            "superseded": [seal(key, s, s.until + offset) for s in live],
        }

    def save(self) -> int:
        """Journal what is taken now (deletes the record once nothing replaced is): the commit's
        sequence number, on disk once `journal.durable()` returns."""
        record = self.record()
        return self.journal.commit(meta={META_KEY: None if record is None else json.dumps(record, sort_keys=True)})

    def save_quietly(self) -> None:
        """`save` from CredentialRotation.on_change: a failed journal write stops the broker
        through the journal's own failure path; the caller (an RPC's authentication) goes on."""
        try:
            self.save()
        except JournalWriteError:
            pass

    def restore(self) -> int:
        """Take back the replaced generations still within their grace: how many were taken."""
        text = self.journal.meta_value(META_KEY)
        if text is None:
            return 0
        key = _key(self.rotation.current)
        try:
            record = json.loads(text)
            if not isinstance(record, dict) or record.get("version") != _VERSION or key is None:
                raise SealError("a record this broker cannot read")
            offset = self.rotation.now() - self._wall()
            restored = []
            for entry in record["superseded"]:
                generation, deadline, values = unseal(key, entry)
                creds = dataclasses.replace(
                    self.rotation.current, api_token=values["api_token"], replica_token=values["replica_token"],
                    operator_token=values["operator_token"], replica_secret=values["replica_secret"],
                )  # fmt: skip
                restored.append(SupersededCredentials(creds, deadline + offset, generation))
            current_generation = int(record["generation"])
        except (SealError, KeyError, TypeError, ValueError) as err:
            log.warning("credential_grace_not_restored", error=str(err) if isinstance(err, SealError) else "a damaged record",
                        consequence="the broker takes only the credentials it read at start: replicas still on "
                                    "the credentials a rotation before the restart replaced are refused")  # fmt: skip
            self.journal.commit(meta={META_KEY: None})
            return 0
        self.rotation.restore(current_generation, restored)
        taken = self.rotation.superseded()
        log.info("credential_grace_restored", generations=len(taken),
                 grace_seconds=round(self.rotation.grace_left_s(), 1),
                 effect="the credentials replaced by rotations before the restart are taken until their grace ends")  # fmt: skip
        if len(taken) != len(restored):
            self.save()  # what ended while the broker was down leaves the record
        return len(taken)


__all__ = ["CredentialGraceStore", "META_KEY", "SealError", "seal", "unseal"]
