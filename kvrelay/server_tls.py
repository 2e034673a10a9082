"""A TLS server's certificate and key, swappable while it serves (`kvrelay rotate-secrets`, or
the files replaced on disk: `CertificateFiles`).

gRPC's dynamic server credentials (`grpc.dynamic_ssl_server_credentials`) ask a fetcher at each
new connection's handshake whether the certificate configuration changed: `ServerCertificates`
answers with a swapped-in one once, then "unchanged". So after `swap` every new connection gets
the new certificate, and connections already up keep theirs (a TLS session is never re-keyed
from under a stream): nothing is cut, nothing restarted.

A pair is swapped in only after `check_server_pair` proved it usable: the key is the
certificate's, and a client trusting `security.tls.ca_file` completes a TLS handshake against it
(an in-memory handshake with the stdlib `ssl` module: the chain, the validity dates and the key
in one check). The PEM bytes checked are the bytes served (read once, bounded,
kvrelay.security.read_server_tls), and a private key never touches the disk on the way (an
in-memory file, memfd_create).

A replica (AR, DiT) watches its own files instead (`CertificateFiles`): the operator rotates a
replica's pair on its host, where the broker's rotate-secrets RPC does not reach. At a new
handshake, and when the process dials a new channel, the files are looked at (three `stat`
calls, at most once per TLS_FILES_CHECK_INTERVAL_S); changed ones are read and checked like
rotate-secrets' (`check_server_pair`), and taken only when they pass. A bad pair, or one
half-replaced (the certificate written, not yet its key), is refused with one warning and the
pair held is kept; the files are checked again once they change again.

A process's own channels present the pair it serves as their client certificate, dialled again
once it is replaced (`RenewingChannel`, over `ServerCertificates.client_pair`): a replica's
channel to the broker and the AR's PutKv channels (the files' pair), and the broker's channels to
its replicas (the pair `kvrelay rotate-secrets` swapped in: `renewing_dial`). Calls made from
then on go over the new channel; the replaced one closes once its calls returned.

Owns the swap, the check and the watch only; never logs key material.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final, Protocol

import grpc

from kvrelay.logging import get_logger
from kvrelay.security import (
    ChannelDial,
    ChannelSecurity,
    Metadata,
    SecurityError,
    TlsMaterial,
    make_channel,
    read_tls,
    tls_files,
)

if TYPE_CHECKING:
    from kvrelay.config import SecurityConfig

log = get_logger(__name__)

# How often at most a process looks at its TLS files for a replaced pair (three stat calls; the
# files are read only when one of them changed).
TLS_FILES_CHECK_INTERVAL_S: Final = 1.0

# How long a channel dialled with a replaced client certificate lets its calls run before it is
# closed (calls to the broker are short: reports, reservations, heartbeats).
REPLACED_CHANNEL_GRACE_S: Final = 60.0

# (inode, size, mtime in ns) of each of the certificate, key and CA files; None: not there.
_FileSignature = tuple[tuple[int, int, int] | None, ...]


def _configuration(tls: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    assert tls.cert_chain is not None and tls.private_key is not None
    return grpc.ssl_server_certificate_configuration(
        [(tls.private_key, tls.cert_chain)], root_certificates=tls.root_certificates
    )


def _same_pair(a: TlsMaterial, b: TlsMaterial) -> bool:
    return (a.cert_chain, a.private_key, a.root_certificates) == (b.cert_chain, b.private_key, b.root_certificates)


class ClientPair(Protocol):
    """The certificate and key a process's channels present (`RenewingChannel`): `tls` now, and
    `generation`, counting the pairs taken; `refresh` looks for a replaced one (at most when `due`)."""

    @property
    def name(self) -> str: ...

    @property
    def generation(self) -> int: ...

    @property
    def tls(self) -> TlsMaterial: ...

    def due(self) -> bool: ...

    def refresh(self) -> bool: ...


class CertificateFiles:
    """The TLS files of process `name` (security.tls, `{name}` resolved) and the pair last taken
    from them (`tls`, `generation` counting the pairs taken since start). `refresh` (or `current`)
    takes a replaced pair once it passes `check_server_pair` (the module docstring). Thread-safe;
    picklable (an AR's ranks get it in their spec and watch the files themselves)."""

    def __init__(
        self,
        cfg: SecurityConfig,
        name: str,
        tls: TlsMaterial,
        *,
        check_interval_s: float = TLS_FILES_CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cfg.tls is None:
            raise SecurityError("security.tls: no TLS files to watch")
        self.name = name
        self.where = tls_files(cfg, name)
        self.paths = (cfg.tls.cert_file.replace("{name}", name), cfg.tls.key_file.replace("{name}", name),
                      cfg.tls.ca_file)  # fmt: skip
        self.tls = tls
        self.generation = 0
        self.refusals = 0
        self.check_interval_s = check_interval_s
        self._cfg = cfg
        self._clock = clock
        # What the files were when `tls` was read at start: only a change of them is looked at.
        self._seen = self._signature()
        self._next_check = clock() + check_interval_s
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._next_check = 0.0  # another process's clock

    def _signature(self) -> _FileSignature:
        out: list[tuple[int, int, int] | None] = []
        for path in self.paths:
            try:
                st = os.stat(path)
            except OSError:
                out.append(None)
                continue
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def due(self) -> bool:
        """Whether `refresh` would look at the files now (a clock read: no file touched)."""
        return self._clock() >= self._next_check

    def current(self) -> TlsMaterial:
        """The pair to present now (a new channel's client certificate): the files' once checked."""
        self.refresh()
        return self.tls

    def refresh(self) -> bool:
        """Take the files' pair if they changed and it passes the check; True when one was taken.
        Never raises for what the files hold: a refused pair is logged (once per change of the
        files) and the pair held stays. Cheap when nothing changed: a clock read, or three stats."""
        now = self._clock()
        if now < self._next_check or not self._lock.acquire(blocking=False):
            return False  # looked at moments ago, or another thread is looking now
        try:
            self._next_check = now + self.check_interval_s
            seen = self._signature()
            if seen == self._seen:
                return False
            self._seen = seen
            try:
                tls = read_tls(self._cfg, self.name)
                assert tls is not None
                check_server_pair(tls, self.where)
            except SecurityError as err:
                self.refusals += 1
                log.warning("tls_files_refused", process=self.name, error=str(err),
                            consequence="the certificate and key held stay in use; the files are checked again "
                                        "once they change (replace the certificate and its key both)")  # fmt: skip
                return False
            if _same_pair(tls, self.tls):
                return False
            self.tls = tls
            self.generation += 1
            log.info("tls_files_reloaded", process=self.name, generation=self.generation,
                     effect="new connections to this process and new channels it dials present the new "
                            "certificate; connections up keep theirs")  # fmt: skip
            return True
        finally:
            self._lock.release()


class ServerCertificates:
    """What one TLS server presents (the module docstring). `tls` is the material served to new
    connections from now on; with `files`, what they hold once replaced and checked."""

    def __init__(self, tls: TlsMaterial, files: CertificateFiles | None = None) -> None:
        if tls.cert_chain is None or tls.private_key is None:
            raise SecurityError("security.tls: a server needs cert_file and key_file")
        self.tls = tls
        self.files = files
        self._initial = _configuration(tls)
        # gRPC calls the fetcher from its own threads, one handshake at a time or several.
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._generation = files.generation if files is not None else 0
        self.swaps = 0

    def credentials(self) -> grpc.ServerCredentials:
        """The server credentials to listen with (`add_secure_port`)."""
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self._fetch, require_client_authentication=self.tls.require_client_cert
        )

    def swap(self, tls: TlsMaterial) -> None:
        """Serve `tls` to every connection made from now on (checked by the caller:
        `check_server_pair`); connections already up keep what they have."""
        config = _configuration(tls)
        with self._lock:
            self._pending = config
            self.tls = tls
            self.swaps += 1

    def client_pair(self) -> ClientPair:
        """What this process's channels present as their client certificate: the files' pair (a
        replica, `watched_certificates`), else the pair served, as `swap` replaces it (the broker)."""
        return self.files if self.files is not None else _SwappedPair(self)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None or self.files is None:
            return pending
        try:
            return self._from_files(self.files)
        except Exception as err:  # noqa: BLE001 - on gRPC's handshake thread: keep serving the pair held
            log.warning("tls_files_check_failed", process=self.files.name, error=f"{type(err).__name__}: {err}",
                        consequence="the certificate and key held stay in use")  # fmt: skip
            return None

    def _from_files(self, files: CertificateFiles) -> grpc.ServerCertificateConfiguration | None:
        # The files may also have been taken by a channel this process dialled (files.current).
        files.refresh()
        with self._lock:
            if files.generation == self._generation:
                return None
            self._generation = files.generation
            self.tls = files.tls
            self.swaps += 1
        return _configuration(files.tls)


class _SwappedPair:
    """The pair a ServerCertificates without files serves, as a ClientPair: replaced only by
    `swap` (the broker's, by `kvrelay rotate-secrets`), so there are no files to look at."""

    name = "server"

    def __init__(self, certificates: ServerCertificates) -> None:
        self._certificates = certificates

    @property
    def generation(self) -> int:
        return self._certificates.swaps

    @property
    def tls(self) -> TlsMaterial:
        return self._certificates.tls

    def due(self) -> bool:
        return False

    def refresh(self) -> bool:
        return False


def watched_certificates(cfg: SecurityConfig, name: str, tls: TlsMaterial | None) -> ServerCertificates | None:
    """The certificates replica `name` serves, taken again from its files when they are replaced
    (`CertificateFiles`); None without TLS. The same `files` give its new channels their client
    certificate (`ServerCertificates.files.current()`)."""
    if tls is None:
        return None
    return ServerCertificates(tls, CertificateFiles(cfg, name, tls))


class RenewingChannel(grpc.aio.Channel):  # type: ignore[misc]
    """A grpc.aio channel that presents the client certificate `files` holds (a replica's files,
    `CertificateFiles`; the broker's pair, `ServerCertificates.client_pair`): once it took a new
    pair, calls from then on go over a channel dialled with it, and the channel before closes
    once its calls returned (`close_grace_s` at most). Files are looked at off the event loop (a
    thread), at most once per their check interval, when a call is made; a call never waits for
    that look."""

    def __init__(self, dial: Callable[[TlsMaterial], grpc.aio.Channel], files: ClientPair,
                 close_grace_s: float = REPLACED_CHANNEL_GRACE_S) -> None:  # fmt: skip
        self._dial = dial
        self._files = files
        self._close_grace_s = close_grace_s
        self._generation = files.generation
        self._channel = dial(files.tls)
        self._looking: asyncio.Future[bool] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.renewals = 0

    def current(self) -> grpc.aio.Channel:
        """The channel a call made now goes over."""
        files = self._files
        if self._looking is None and files.due():
            self._looking = asyncio.ensure_future(asyncio.to_thread(files.refresh))
            self._looking.add_done_callback(self._looked)
        if files.generation != self._generation:
            old, self._generation = self._channel, files.generation
            self._channel = self._dial(files.tls)
            self.renewals += 1
            task = asyncio.get_running_loop().create_task(old.close(grace=self._close_grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return self._channel

    def _looked(self, looking: asyncio.Future[bool]) -> None:
        self._looking = None
        if not looking.cancelled() and looking.exception() is not None:
            log.warning("tls_files_check_failed", process=self._files.name, error=str(looking.exception()),
                        consequence="the certificate and key held stay in use")  # fmt: skip

    def unary_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                    **kwargs: Any) -> Any:  # fmt: skip
        return _RenewingCallable(self, "unary_unary", method, request_serializer, response_deserializer, kwargs)

    def unary_stream(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                     **kwargs: Any) -> Any:  # fmt: skip
        return _RenewingCallable(self, "unary_stream", method, request_serializer, response_deserializer, kwargs)

    def stream_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                     **kwargs: Any) -> Any:  # fmt: skip
        return _RenewingCallable(self, "stream_unary", method, request_serializer, response_deserializer, kwargs)

    def stream_stream(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                      **kwargs: Any) -> Any:  # fmt: skip
        return _RenewingCallable(self, "stream_stream", method, request_serializer, response_deserializer, kwargs)

    async def close(self, grace: float | None = None) -> None:
        if self._looking is not None:
            self._looking.cancel()
        await self._channel.close(grace)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    async def __aenter__(self) -> RenewingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(None)


class _RenewingCallable:
    """One RPC of a RenewingChannel: each call goes over the channel current then."""

    def __init__(self, owner: RenewingChannel, kind: str, method: str, request_serializer: Any,
                 response_deserializer: Any, options: dict[str, Any]) -> None:  # fmt: skip
        self._owner, self._kind, self._method = owner, kind, method
        self._serializers = {"request_serializer": request_serializer, "response_deserializer": response_deserializer,
                             **options}  # fmt: skip

    def __call__(self, request: Any, **kwargs: Any) -> Any:
        channel = self._owner.current()
        return getattr(channel, self._kind)(self._method, **self._serializers)(request, **kwargs)


def renewing_dial(pair: ClientPair, close_grace_s: float = REPLACED_CHANNEL_GRACE_S) -> ChannelDial:
    """`make_channel`, but each channel a RenewingChannel presenting `pair` (whatever TLS material
    the security it is given holds): for a ChannelCache (the broker's channels to its replicas,
    `close_grace_s` the longest call it makes) or one channel (`broker_channel`)."""

    def dial(target: str, security: ChannelSecurity | None = None, **kwargs: Any) -> grpc.aio.Channel:
        security = security or ChannelSecurity()
        return RenewingChannel(
            lambda tls: make_channel(target, dataclasses.replace(security, tls=tls), **kwargs), pair, close_grace_s
        )

    return dial


def broker_channel(target: str, security: ChannelSecurity, certificates: ServerCertificates | None,
                   live_metadata: Callable[[], Metadata] | None = None) -> grpc.aio.Channel:  # fmt: skip
    """A replica's channel to the broker (`make_channel`): with TLS files watched
    (`watched_certificates`), one that presents the client certificate they hold (RenewingChannel)."""
    files = certificates.files if certificates is not None else None
    if files is None:
        return make_channel(target, security, live_metadata=live_metadata)
    return renewing_dial(files)(target, security, live_metadata=live_metadata)


@contextmanager
def _memory_file(data: bytes) -> Iterator[str]:
    """A path to `data` that lives in memory only (Linux memfd), closed on exit."""
    fd = os.memfd_create("kvrelay-tls-check", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def check_server_pair(tls: TlsMaterial, where: str) -> None:
    """Raise SecurityError (naming `where`, the config keys and files, and why) unless a client
    that trusts `tls.root_certificates` completes a TLS handshake with a server presenting
    `tls.cert_chain` and `tls.private_key`: a key that is not the certificate's, a certificate
    another CA signed, one expired or not yet valid, PEM that holds no certificate or key."""
    if tls.cert_chain is None or tls.private_key is None:
        raise SecurityError(f"{where}: a server needs cert_file and key_file")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        with _memory_file(tls.cert_chain) as cert, _memory_file(tls.private_key) as key:
            server.load_cert_chain(cert, key)
    except ssl.SSLError as err:
        why = "the key is not the certificate's" if "KEY_VALUES_MISMATCH" in str(err) else (
            f"not a certificate chain and its private key ({err.reason or 'no certificate or key in the PEM'})")  # fmt: skip
        raise SecurityError(f"{where}: {why}") from None
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False  # the names clients dial are theirs to check; the chain is checked here
    try:
        client.load_verify_locations(cadata=tls.root_certificates.decode("ascii", "replace"))
    except ssl.SSLError as err:
        raise SecurityError(f"{where}: security.tls.ca_file holds no CA certificate ({err.reason or err})") from None
    _handshake(server, client, where)


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, where: str) -> None:
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    s = server.wrap_bio(s_in, s_out, server_side=True)
    c = client.wrap_bio(c_in, c_out, server_side=False)
    done = {"s": False, "c": False}
    for _ in range(16):  # a TLS 1.3 handshake takes 2 round trips; 16 bounds a broken one
        for name, side in (("c", c), ("s", s)):
            if done[name]:
                continue
            try:
                side.do_handshake()
                done[name] = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLCertVerificationError as err:
                raise SecurityError(
                    f"{where}: a client trusting security.tls.ca_file refuses this certificate "
                    f"({err.verify_message or err.reason})"
                ) from None
            except ssl.SSLError as err:
                raise SecurityError(f"{where}: a TLS handshake with this pair fails ({err.reason or err})") from None
        c_in.write(s_out.read())
        s_in.write(c_out.read())
        if done["s"] and done["c"]:
            return
    raise SecurityError(f"{where}: a TLS handshake with this pair does not complete")


__all__ = ["REPLACED_CHANNEL_GRACE_S", "TLS_FILES_CHECK_INTERVAL_S", "CertificateFiles", "ClientPair", "RenewingChannel", "ServerCertificates", "broker_channel", "check_server_pair", "renewing_dial", "watched_certificates"]
