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
the PutKv bearer), so a digest would not do: the record is sealed under keys derived from the
broker's current credentials. The construction is stdlib only (`cryptography`, which has vetted
AEADs, is a test dependency of kvrelay, not one of the broker): HKDF-SHA256 (RFC 5869) from the
current tokens and secret, each length-prefixed, to two keys, one to encrypt and one to
authenticate; the whole payload (every replaced generation with its deadline) encrypted with an
HMAC-SHA256 keystream over a fresh random 128-bit nonce; one HMAC-SHA256 tag, full length, over
the associated data (the record's kind, format version and the current generation), the nonce
and the ciphertext, each length-prefixed; checked in constant time before anything is decrypted
(encrypt-then-MAC). Nothing of the record can be changed, dropped, reordered or renumbered
without the tag failing. Whoever reads the journal alone learns nothing; whoever also holds the
broker's current credential files can already act as anyone. A broker that starts with other
credentials than those it sealed under (files rotated while it was down) cannot open the record:
it is dropped and logged (`credential_grace_not_restored`), and the broker takes only what it
reads, as before this record existed. Deadlines are wall-clock seconds (the rotation's clock is
monotonic and starts again with the process); a generation taken back is taken for at most
`security.rotation_grace_seconds` (as configured now) from the start, whatever the wall clock did
meanwhile.

Format 1 (before: each generation sealed on its own, the record's own fields and the set of
generations not authenticated, the keys derived by HMAC over the joined credentials) is opened
once by a broker that starts, if its entries' tags hold, and sealed again at once in format 2
(`credential_grace_upgraded`): an upgrade during a grace refuses no replica.

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
from kvrelay.security import ROTATED_FIELDS, CredentialRotation, Credentials, SupersededCredentials

log = get_logger(__name__)

# The journal's meta key of the record.
META_KEY: Final = "credential_grace"
_VERSION: Final = 2
_KIND: Final = b"kvrelay.v1.credential-grace"
_NONCE_BYTES: Final = 16
_TAG_BYTES: Final = 32
# HKDF's info strings: one key per purpose (and per format: a format-1 key never serves here).
_ENCRYPT_INFO: Final = _KIND + b".v2.encrypt"
_MAC_INFO: Final = _KIND + b".v2.mac"


class SealError(ValueError):
    """A sealed record cannot be opened: other credentials, or a damaged record."""


def _framed(*parts: bytes) -> bytes:
    """`parts`, each after its length (8 bytes, big-endian): no two lists frame the same."""
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def hkdf_sha256(ikm: bytes, *, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF with SHA-256 (RFC 5869): extract with `salt`, expand to `length` bytes for `info`."""
    if not 0 < length <= 255 * hashlib.sha256().digest_size:
        raise ValueError(f"HKDF-SHA256 gives 1 to 8160 bytes, not {length}")
    prk = hmac.new(salt or bytes(hashlib.sha256().digest_size), ikm, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


@dataclasses.dataclass(frozen=True, slots=True)
class SealKeys:
    """The two keys of one broker's credentials: to encrypt, and to authenticate."""

    encrypt: bytes = dataclasses.field(repr=False)
    mac: bytes = dataclasses.field(repr=False)


def seal_keys(creds: Credentials) -> SealKeys | None:
    """The sealing keys of the broker holding `creds` (None: it holds no credential)."""
    values = [(getattr(creds, f) or "").encode() for f in ROTATED_FIELDS]
    if not any(values):
        return None
    ikm = _framed(*values)
    return SealKeys(hkdf_sha256(ikm, salt=_KIND, info=_ENCRYPT_INFO), hkdf_sha256(ikm, salt=_KIND, info=_MAC_INFO))


def _keystream(key: bytes, nonce: bytes, length: int) -> bytes:
    keyed = hmac.new(key, digestmod=hashlib.sha256)
    out = bytearray()
    for counter in range(-(-length // keyed.digest_size)):
        block = keyed.copy()
        block.update(nonce + counter.to_bytes(8, "big"))
        out += block.digest()
    return bytes(out[:length])


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")


def _associated(generation: int) -> bytes:
    """What the tag binds besides the sealed bytes: the record's kind, format and generation."""
    return _framed(_KIND, str(_VERSION).encode(), str(generation).encode())


def _tag(keys: SealKeys, generation: int, nonce: bytes, sealed: bytes) -> bytes:
    return hmac.new(keys.mac, _framed(_associated(generation), nonce, sealed), hashlib.sha256).digest()


def seal_record(keys: SealKeys, generation: int, payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` sealed under `keys` as the record of a broker at `generation`."""
    plain = json.dumps(payload, sort_keys=True).encode()
    nonce = secrets.token_bytes(_NONCE_BYTES)
    sealed = _xor(plain, _keystream(keys.encrypt, nonce, len(plain)))
    return {
        "version": _VERSION,
        "generation": generation,
        "nonce": nonce.hex(),
        "sealed": sealed.hex(),
        "tag": _tag(keys, generation, nonce, sealed).hex(),
    }


def open_record(keys: SealKeys, record: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(the generation it was sealed at, the payload) of a format-2 record sealed under `keys`."""
    try:
        generation = int(record["generation"])
        nonce, sealed, tag = (bytes.fromhex(str(record[k])) for k in ("nonce", "sealed", "tag"))
    except (KeyError, TypeError, ValueError) as err:
        raise SealError(f"a damaged record ({type(err).__name__})") from None
    if len(nonce) != _NONCE_BYTES or len(tag) != _TAG_BYTES:
        raise SealError("a damaged record (a nonce or tag of another length)")
    if not hmac.compare_digest(tag, _tag(keys, generation, nonce, sealed)):
        raise SealError("sealed under other credentials than the broker holds now, or damaged")
    payload = json.loads(_xor(sealed, _keystream(keys.encrypt, nonce, len(sealed))))
    if not isinstance(payload, dict):
        raise SealError("a damaged record (no payload)")
    return generation, payload


# ---------------------------------------------------------------- format 1, read once


_V1_LABEL: Final = b"kvrelay.v1.credential-grace."


def _v1_subkey(creds: Credentials, label: bytes) -> bytes | None:
    values = [getattr(creds, f) or "" for f in ROTATED_FIELDS]
    if not any(values):
        return None
    key = hmac.new(b"\x00".join(v.encode() for v in values), _V1_LABEL + b"key", hashlib.sha256).digest()
    return hmac.new(key, _V1_LABEL + label, hashlib.sha256).digest()


def open_v1(creds: Credentials, record: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(generation, payload as `open_record` gives it) of a format-1 record sealed under `creds`:
    each entry's tag checked (the record's own fields had none; its generation must at least be
    above every entry's)."""
    enc, mac = _v1_subkey(creds, b"encrypt"), _v1_subkey(creds, b"mac")
    if enc is None or mac is None:
        raise SealError("a record this broker cannot read (it holds no credential)")
    superseded = []
    try:
        generation = int(record["generation"])
        for entry in record["superseded"]:
            gen, deadline = int(entry["generation"]), float(entry["deadline"])
            nonce, sealed = bytes.fromhex(entry["nonce"]), bytes.fromhex(entry["sealed"])
            tag = bytes.fromhex(str(entry["tag"]))
            header = f"{gen}\x00{deadline!r}\x00".encode()
            if not hmac.compare_digest(tag, hmac.new(mac, nonce + header + sealed, hashlib.sha256).digest()):
                raise SealError("sealed under other credentials than the broker holds now, or damaged")
            values = json.loads(_xor(sealed, _keystream(enc, nonce, len(sealed))))
            superseded.append({"generation": gen, "deadline": deadline, **{f: values.get(f) for f in ROTATED_FIELDS}})
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        if isinstance(err, SealError):
            raise
        raise SealError(f"a damaged record ({type(err).__name__})") from None
    return generation, {"superseded": superseded}


# ---------------------------------------------------------------- the payload


def _generations(payload: dict[str, Any], current: int) -> list[tuple[int, float, dict[str, str | None]]]:
    """The (generation, wall-clock deadline, tokens and secret) the payload holds, checked."""
    out: list[tuple[int, float, dict[str, str | None]]] = []
    for entry in payload["superseded"]:
        generation, deadline = int(entry["generation"]), float(entry["deadline"])
        values = {f: entry.get(f) for f in ROTATED_FIELDS}
        if not all(v is None or isinstance(v, str) for v in values.values()):
            raise SealError("a damaged record (a credential that is not text)")
        if not 0 <= generation < current or any(g == generation for g, _, _ in out):
            raise SealError(f"a damaged record (generation {generation} beside current generation {current})")
        out.append((generation, deadline, values))
    return out


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
        keys = seal_keys(self.rotation.current)
        if not live or keys is None:
            return None
        offset = self._wall() - self.rotation.now()
        payload = {
            "superseded": [
                {"generation": s.generation, "deadline": s.until + offset,
                 **{f: getattr(s.creds, f) for f in ROTATED_FIELDS}}
                for s in live
            ],
        }  # fmt: skip
        return seal_record(keys, self.rotation.generation, payload)

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
        upgraded = False
        try:
            record = json.loads(text)
            version = record.get("version") if isinstance(record, dict) else None
            keys = seal_keys(self.rotation.current)
            if version == _VERSION and keys is not None:
                current_generation, payload = open_record(keys, record)
            elif version == 1:
                current_generation, payload = open_v1(self.rotation.current, record)
                upgraded = True
            else:
                raise SealError("a record this broker cannot read" if keys is None
                                else f"a record of format {version!r}, which this broker does not read")  # fmt: skip
            offset = self.rotation.now() - self._wall()
            # No generation is taken longer than the grace configured now: a wall clock set back
            # while the broker was down (a host whose clock was wrong at boot) would otherwise
            # stretch the grace by as much, and an operator who lowered rotation_grace_seconds
            # and restarted the broker would keep the old one.
            latest = self.rotation.now() + self.rotation.current.rotation_grace_s
            restored = []
            for generation, deadline, values in _generations(payload, current_generation):
                creds = dataclasses.replace(self.rotation.current, **values)  # type: ignore[arg-type]
                restored.append(SupersededCredentials(creds, min(deadline + offset, latest), generation))
        except (SealError, KeyError, TypeError, ValueError, AttributeError) as err:
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
        if upgraded:
            log.info("credential_grace_upgraded", from_format=1, to_format=_VERSION,
                     effect="the record of an earlier kvrelay was read once and sealed again in the current format")  # fmt: skip
        if upgraded or len(taken) != len(restored):
            self.save()  # the current format; what ended while the broker was down leaves the record
        return len(taken)


__all__ = ["CredentialGraceStore", "META_KEY", "SealError", "SealKeys", "hkdf_sha256", "open_record", "open_v1",
           "seal_keys", "seal_record"]
