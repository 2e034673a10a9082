"""A throwaway certificate authority for tests (the `cryptography` package): one CA, leaf
certificates for 127.0.0.1/localhost with a chosen common name, written as PEM files; and what
the TLS tests do with them (tests/security/test_tls_*.py): install a pair as a process's files,
see the certificate a server presents, generate an image as a client of the CA."""

from __future__ import annotations

import datetime as dt
import io
import ipaddress
import os
import shutil
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from tests.procs import ServiceProcess


@dataclass(frozen=True)
class Leaf:
    cert: Path
    key: Path

    def pem(self) -> tuple[bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes()

    def der(self) -> bytes:
        """The certificate, DER (what a TLS peer sees: `presented`)."""
        return x509.load_pem_x509_certificate(self.cert.read_bytes()).public_bytes(serialization.Encoding.DER)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


class TestCa:
    """`TestCa(tmp).issue("kvrelay-node")` -> Leaf(cert, key); `ca.path` is the CA certificate."""

    __test__ = False  # not a pytest class

    def __init__(self, folder: Path, name: str = "kvrelay test CA") -> None:
        self.folder = folder
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.path = folder / "ca.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, common_name: str, *, expired: bool = False) -> Leaf:
        """A leaf for `common_name`, valid from 5 minutes ago for a day (`expired`: from 3 days
        ago until yesterday), written to `folder`/`common_name`.pem and .key."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        start, end = (now - dt.timedelta(days=3), now - dt.timedelta(days=1)) if expired else (
            now - dt.timedelta(minutes=5), now + dt.timedelta(days=1))  # fmt: skip
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        leaf = Leaf(self.folder / f"{common_name}.pem", self.folder / f"{common_name}.key")
        leaf.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, leaf.key)
        return leaf


def tls_security(live: Path, ca: Path, *, require_client_cert: bool = True) -> dict[str, Any]:
    """A `security:` section whose processes read `live`/`{name}`.pem and .key, trusting `ca`."""
    return {"tls": {"cert_file": str(live / "{name}.pem"), "key_file": str(live / "{name}.key"),
                    "ca_file": str(ca), "require_client_cert": require_client_cert}}  # fmt: skip


def write_tls_config(folder: Path, live: Path, ca: Path, *, name: str = "tls", grpc_fallback: bool = False,
                     num_replicas: int | None = None) -> Path:  # fmt: skip
    """tests/configs/test-fast.yaml with mutual TLS (`tls_security(live, ca)`) and its journal in
    `folder`, written as `folder`/`name`.yaml; `grpc_fallback`: no kv_transfer_config (the AR's
    rank dials PutKv, over TLS); `num_replicas`: of each stage."""
    import yaml

    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(folder / "broker.sqlite")
    data["security"] = tls_security(live, ca)
    for stage in data["stages"]:
        if grpc_fallback:
            stage.pop("kv_transfer_config", None)
        if num_replicas is not None:
            stage["num_replicas"] = num_replicas
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def install_pair(live: Path, name: str, cert: Path | None, key: Path | None) -> None:
    """Replace process `name`'s files in `live` (`name`.pem, `name`.key) as an operator would:
    each file written aside, then renamed; None leaves that file as it is (half a replacement)."""
    for src, suffix in ((cert, "pem"), (key, "key")):
        if src is not None:
            shutil.copyfile(src, live / f"{name}.{suffix}.tmp")
            os.replace(live / f"{name}.{suffix}.tmp", live / f"{name}.{suffix}")


def presented(address: str, ca: Path, client: Leaf | None = None) -> bytes:
    """The certificate the server at `address` presents to a new TLS connection (DER), checked
    against `ca`; `client`: the certificate shown to a server that requires one."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as sock, \
            context.wrap_socket(sock, server_hostname="localhost") as tls:  # fmt: skip
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def generate_image(target: str, ca: Path, client: Leaf, seed: int) -> None:
    """One 64x64 generation through the broker at `target`, as a client of `ca` (mutual TLS)."""
    from PIL import Image

    from kvrelay.client import KvRelayClient

    chain, key = client.pem()
    with KvRelayClient(target, root_certificates=ca.read_bytes(), certificate_chain=chain, private_key=key) as c:
        result = c.generate("a lighthouse at dusk", width=64, height=64, seed=seed, timeout=120).result()
    assert Image.open(io.BytesIO(result.png)).size == (64, 64)


def count_events(proc: ServiceProcess, event: str) -> int:
    """How many times the process logged `event` (JSON logs)."""
    return sum(f'"{event}"' in line for line in proc.lines)


class RecordingServer:
    """A grpc.aio server with mutual TLS (`leaf`, clients of `ca`): `/t.T/Call` echoes its request
    and records the client certificate it came with (`seen`, PEM); `/t.T/Held` streams "started",
    then "finished" once `release` is set (a call kept in flight). Made on the test's loop."""

    def __init__(self, leaf: Leaf, ca: Path) -> None:
        import asyncio

        import grpc

        self.seen: list[bytes] = []
        self.release = asyncio.Event()

        async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.seen.append(context.auth_context()["x509_pem_cert"][0])
            return request

        async def held(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            yield b"started"
            await self.release.wait()
            yield b"finished"

        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
            "Call": grpc.unary_unary_rpc_method_handler(call),
            "Held": grpc.unary_stream_rpc_method_handler(held),
        }),))  # fmt: skip
        chain, key = leaf.pem()
        port = self.server.add_secure_port(
            "127.0.0.1:0", grpc.ssl_server_credentials([(key, chain)], ca.read_bytes(), require_client_auth=True)
        )
        self.target = f"localhost:{port}"
