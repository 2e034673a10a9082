"""A TLS server's certificate and key, swappable while it serves (`kvrelay rotate-secrets`).

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

Owns the swap and the check only; never logs key material.
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from kvrelay.security import SecurityError, TlsMaterial


def _configuration(tls: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    assert tls.cert_chain is not None and tls.private_key is not None
    return grpc.ssl_server_certificate_configuration(
        [(tls.private_key, tls.cert_chain)], root_certificates=tls.root_certificates
    )


class ServerCertificates:
    """What one TLS server presents (the module docstring). `tls` is the material served to new
    connections from now on."""

    def __init__(self, tls: TlsMaterial) -> None:
        if tls.cert_chain is None or tls.private_key is None:
            raise SecurityError("security.tls: a server needs cert_file and key_file")
        self.tls = tls
        self._initial = _configuration(tls)
        # gRPC calls the fetcher from its own threads, one handshake at a time or several.
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None
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

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            pending, self._pending = self._pending, None
        return pending


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


__all__ = ["ServerCertificates", "check_server_pair"]
