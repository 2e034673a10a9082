"""AR and DiT replicas take a replaced TLS certificate and key from their files without a restart
(kvrelay/server_tls.py CertificateFiles; docs/operations.md, Rotating the replica secret): real
`kvrelay broker`, `kvrelay ar` and `kvrelay dit` processes over the gRPC fallback (PutKv from the
AR's rank), mutual TLS on every channel, certificates of a throwaway CA (tests/security/certs.py).

After both replicas' files hold a new pair, a new connection to each sees the new certificate
while a channel opened before keeps working; a pair that does not match (the key of another
certificate) or one half-replaced (the certificate written, not yet its key) is refused with
one warning, the pair held kept, and the key written after brings the new pair in; an image
comes out after each step. The AR's PutKv channel to a DiT, and a replica's channel to the
broker, dial again with the new client certificate (checked against servers that record the
certificate each caller presents), and a call in flight on the channel replaced finishes."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from kvrelay.client import KvRelayClient
from kvrelay.config import SecurityConfig
from kvrelay.security import ChannelSecurity, read_tls
from kvrelay.server_tls import CertificateFiles, RenewingChannel, ServerCertificates, broker_channel
from kvrelay.transfer.grpc_stream import GrpcStreamSender
from kvrelay.v1 import dit_pb2
from tests.procs import ServiceProcess, start_service
from tests.security.certs import Leaf, TestCa
from tests.security.harness import REPO

pytestmark = pytest.mark.slow
REPLICAS = ("dit-0", "ar-0")


@pytest.fixture(autouse=True)
def _no_ambient_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("KVRELAY_API_TOKEN", "KVRELAY_OPERATOR_TOKEN", "KVRELAY_REPLICA_TOKEN", "KVRELAY_REPLICA_SECRET"):
        monkeypatch.delenv(env, raising=False)


def _der(leaf: Leaf) -> bytes:
    return x509.load_pem_x509_certificate(leaf.cert.read_bytes()).public_bytes(serialization.Encoding.DER)


def _presented(address: str, ca: Path, client: Leaf) -> bytes:
    """The certificate the server at `address` presents to a new TLS connection (DER)."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(client.cert), str(client.key))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as sock, \
            context.wrap_socket(sock, server_hostname="localhost") as tls:  # fmt: skip
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _install(live: Path, name: str, cert: Path | None, key: Path | None) -> None:
    """Replace `name`'s files as an operator would: each file written aside, then renamed."""
    for src, suffix in ((cert, "pem"), (key, "key")):
        if src is not None:
            shutil.copyfile(src, live / f"{name}.{suffix}.tmp")
            os.replace(live / f"{name}.{suffix}.tmp", live / f"{name}.{suffix}")


def _until_presented(address: str, ca: Path, client: Leaf, expected: bytes, proc: ServiceProcess) -> None:
    # Each attempt is a new handshake, which is what makes the server look at its files.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _presented(address, ca, client) == expected:
            return
        time.sleep(0.2)
    pytest.fail(f"{address} still presents its old certificate:\n{proc.output()}")


def _until_refused(address: str, ca: Path, client: Leaf, proc: ServiceProcess, seen: int) -> bytes:
    """Handshake until the process logged one more refusal of its files; the certificate then."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        _presented(address, ca, client)
        if _count(proc, "tls_files_refused") > seen:
            return _presented(address, ca, client)
        time.sleep(0.2)
    pytest.fail(f"{address} never refused its new files:\n{proc.output()}")


def _count(proc: ServiceProcess, event: str) -> int:
    return sum(f'"{event}"' in line for line in proc.lines)


def _health_ok(channel: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _generate(target: str, ca: Path, client: Leaf, seed: int) -> None:
    chain, key = client.pem()
    with KvRelayClient(target, root_certificates=ca.read_bytes(), certificate_chain=chain, private_key=key) as c:
        result = c.generate("a lighthouse at dusk", width=64, height=64, seed=seed, timeout=120).result()
    assert Image.open(io.BytesIO(result.png)).size == (64, 64)


def _until_serving(proc: ServiceProcess, channel: grpc.Channel) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if _health_ok(channel):
                return
        except grpc.RpcError:
            pass
        time.sleep(0.3)
    pytest.fail(f"not SERVING:\n{proc.output()}")


def test_replicas_take_a_replaced_certificate_from_their_files_and_refuse_a_bad_one(tmp_path: Path) -> None:
    for sub in ("ca", "a", "b", "c", "live"):
        (tmp_path / sub).mkdir()
    ca = TestCa(tmp_path / "ca")
    live = tmp_path / "live"
    leaves: dict[str, dict[str, Leaf]] = {}
    for generation in ("a", "b", "c"):
        ca.folder = tmp_path / generation
        leaves[generation] = {name: ca.issue(name) for name in (*REPLICAS, "broker")}
    ca.folder = tmp_path / "ca"
    client = ca.issue("alice")
    for name in (*REPLICAS, "broker"):
        _install(live, name, leaves["a"][name].cert, leaves["a"][name].key)
    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp_path / "broker.sqlite")
    data["security"] = {"tls": {"cert_file": str(live / "{name}.pem"), "key_file": str(live / "{name}.key"),
                                "ca_file": str(ca.path), "require_client_cert": True}}  # fmt: skip
    for stage in data["stages"]:
        stage.pop("kv_transfer_config", None)  # the gRPC fallback: the AR's rank dials PutKv
    config = tmp_path / "tls.yaml"
    config.write_text(yaml.safe_dump(data))

    procs: dict[str, ServiceProcess] = {}
    channels: dict[str, grpc.Channel] = {}
    try:
        procs["broker"] = start_service(["broker", "--config", str(config), "--port", "0", "--metrics-port", "0"],
                                        cwd=tmp_path)  # fmt: skip
        target = procs["broker"].address
        for name in REPLICAS:
            procs[name] = start_service(
                [name.split("-")[0], "--config", str(config), "--port", "0", "--metrics-port", "0",
                 "--broker", target], cwd=tmp_path, timeout=120,
            )  # fmt: skip
        chain, key = client.pem()
        creds = grpc.ssl_channel_credentials(ca.path.read_bytes(), key, chain)
        for name in REPLICAS:
            channels[name] = grpc.secure_channel(procs[name].address, creds,
                                                 [("grpc.ssl_target_name_override", "localhost")])  # fmt: skip
            _until_serving(procs[name], channels[name])
        _generate(target, ca.path, client, 1)
        for name in REPLICAS:
            assert _presented(procs[name].address, ca.path, client) == _der(leaves["a"][name])

        # The new pair in place: new connections get it, the channels up before go on.
        for name in REPLICAS:
            _install(live, name, leaves["b"][name].cert, leaves["b"][name].key)
        for name in REPLICAS:
            _until_presented(procs[name].address, ca.path, client, _der(leaves["b"][name]), procs[name])
            assert _health_ok(channels[name])
        _generate(target, ca.path, client, 2)

        # A mismatched pair (generation c's certificate, generation b's key): refused, b kept.
        for name in REPLICAS:
            seen = _count(procs[name], "tls_files_refused")
            _install(live, name, leaves["c"][name].cert, None)  # half-replaced: its key not yet
            assert _until_refused(procs[name].address, ca.path, client, procs[name], seen) == _der(leaves["b"][name])
            assert _count(procs[name], "tls_files_refused") == seen + 1  # one warning, not one per handshake
            assert _health_ok(channels[name])
        _generate(target, ca.path, client, 3)

        # Its key written after: the pair is consistent again, and taken.
        for name in REPLICAS:
            _install(live, name, None, leaves["c"][name].key)
        for name in REPLICAS:
            _until_presented(procs[name].address, ca.path, client, _der(leaves["c"][name]), procs[name])
            assert _health_ok(channels[name])
        _generate(target, ca.path, client, 4)
        # Two pairs taken by each server (the AR's rank, dialling PutKv, watches the files too).
        assert _count(procs["dit-0"], "tls_files_reloaded") == 2, procs["dit-0"].output()
        assert _count(procs["ar-0"], "tls_files_reloaded") >= 2, procs["ar-0"].output()
    finally:
        for channel in channels.values():
            channel.close()
        for name in (*REPLICAS, "broker"):
            if name in procs:
                assert procs[name].stop(timeout=30) == 0, procs[name].output()


class _PresentedCertificates:
    """A PutKv server (mutual TLS) that records the client certificate of each call."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self._lock = threading.Lock()

    def put_kv(self, requests: Iterator[Any], context: grpc.ServicerContext) -> dit_pb2.PutKvResponse:
        for _ in requests:
            pass
        pem = context.auth_context().get("x509_pem_cert", [b""])[0]
        with self._lock:
            self.seen.append(pem)
        return dit_pb2.PutKvResponse()


def test_a_put_kv_channel_dials_again_with_the_replaced_client_certificate(tmp_path: Path) -> None:
    for sub in ("ca", "a", "b", "live"):
        (tmp_path / sub).mkdir()
    ca = TestCa(tmp_path / "ca")
    server_leaf = ca.issue("dit-0")
    ca.folder = tmp_path / "a"
    first = ca.issue("ar-0")
    ca.folder = tmp_path / "b"
    second = ca.issue("ar-0")
    live = tmp_path / "live"
    _install(live, "ar-0", first.cert, first.key)
    cfg = SecurityConfig.model_validate({"tls": {"cert_file": str(live / "{name}.pem"),
                                                 "key_file": str(live / "{name}.key"), "ca_file": str(ca.path)}})  # fmt: skip
    tls = read_tls(cfg, "ar-0")
    assert tls is not None
    files = CertificateFiles(cfg, "ar-0", tls, check_interval_s=0.0)

    recorder = _PresentedCertificates()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler("kvrelay.v1.DitService", {
        "PutKv": grpc.stream_unary_rpc_method_handler(
            recorder.put_kv, request_deserializer=dit_pb2.PutKvRequest.FromString,
            response_serializer=dit_pb2.PutKvResponse.SerializeToString),
    })  # fmt: skip
    server.add_generic_rpc_handlers((handler,))
    chain, key = server_leaf.pem()
    port = server.add_secure_port(
        "127.0.0.1:0", grpc.ssl_server_credentials([(key, chain)], ca.path.read_bytes(), require_client_auth=True)
    )
    server.start()
    sender = GrpcStreamSender(security=ChannelSecurity(replica_id="ar-0", tls=tls), tls_files=files)
    endpoint = f"localhost:{port}"

    def put_kv() -> None:
        channel = sender._acquire(endpoint)
        try:
            channel.stream_unary("/kvrelay.v1.DitService/PutKv", request_serializer=dit_pb2.PutKvRequest.SerializeToString,
                                 response_deserializer=dit_pb2.PutKvResponse.FromString)(iter(()), timeout=30)  # fmt: skip
        finally:
            sender._release(channel)

    try:
        put_kv()
        _install(live, "ar-0", second.cert, second.key)
        put_kv()
        _install(live, "ar-0", first.cert, second.key)  # a pair that does not match: refused
        put_kv()
        assert files.refusals == 1
        assert recorder.seen == [first.cert.read_bytes(), second.cert.read_bytes(), second.cert.read_bytes()]
    finally:
        sender.close()
        server.stop(None)


def test_a_broker_channel_dials_again_with_the_replaced_client_certificate_and_lets_calls_finish(
    tmp_path: Path,
) -> None:
    for sub in ("ca", "a", "b", "live"):
        (tmp_path / sub).mkdir()
    ca = TestCa(tmp_path / "ca")
    server_leaf = ca.issue("broker")
    ca.folder = tmp_path / "a"
    first = ca.issue("dit-0")
    ca.folder = tmp_path / "b"
    second = ca.issue("dit-0")
    live = tmp_path / "live"
    _install(live, "dit-0", first.cert, first.key)
    cfg = SecurityConfig.model_validate({"tls": {"cert_file": str(live / "{name}.pem"),
                                                 "key_file": str(live / "{name}.key"), "ca_file": str(ca.path)}})  # fmt: skip
    tls = read_tls(cfg, "dit-0")
    assert tls is not None
    certificates = ServerCertificates(tls, CertificateFiles(cfg, "dit-0", tls, check_interval_s=0.0))

    async def scenario() -> None:
        seen: list[bytes] = []
        release = asyncio.Event()

        async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            seen.append(context.auth_context()["x509_pem_cert"][0])
            return request

        async def held(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            yield b"started"
            await release.wait()
            yield b"finished"

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
            "Call": grpc.unary_unary_rpc_method_handler(call),
            "Held": grpc.unary_stream_rpc_method_handler(held),
        }),))  # fmt: skip
        chain, key = server_leaf.pem()
        port = server.add_secure_port(
            "127.0.0.1:0", grpc.ssl_server_credentials([(key, chain)], ca.path.read_bytes(), require_client_auth=True)
        )
        await server.start()
        channel = broker_channel(f"localhost:{port}", ChannelSecurity(replica_id="dit-0", tls=tls), certificates)
        try:
            unary = channel.unary_unary("/t.T/Call")
            assert await unary(b"1", timeout=30) == b"1" and seen[-1] == first.cert.read_bytes()
            stream = channel.unary_stream("/t.T/Held")(b"", timeout=60)
            assert await stream.read() == b"started"  # a call in flight on the first channel

            _install(live, "dit-0", second.cert, second.key)
            for _ in range(600):  # the files are looked at off the loop: a later call sees the new pair
                assert await unary(b"2", timeout=30) == b"2"
                if seen[-1] == second.cert.read_bytes():
                    break
                await asyncio.sleep(0.05)
            assert seen[-1] == second.cert.read_bytes()
            assert isinstance(channel, RenewingChannel) and channel.renewals == 1
            release.set()
            assert await stream.read() == b"finished"  # the replaced channel let it finish
            assert await stream.code() == grpc.StatusCode.OK
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(scenario())
