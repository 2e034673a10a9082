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
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.config import SecurityConfig
from kvrelay.security import ChannelSecurity, TlsMaterial, read_tls
from kvrelay.server_tls import CertificateFiles, RenewingChannel, ServerCertificates, broker_channel
from kvrelay.transfer.grpc_stream import GrpcStreamSender
from kvrelay.v1 import dit_pb2
from tests.procs import ServiceProcess, start_service
from tests.security.certs import (
    Leaf,
    RecordingServer,
    TestCa,
    count_events,
    generate_image,
    install_pair,
    presented,
    tls_security,
    write_tls_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_ambient_tokens")]
REPLICAS = ("dit-0", "ar-0")


def _until_presented(address: str, ca: Path, client: Leaf, expected: bytes, proc: ServiceProcess) -> None:
    # Each attempt is a new handshake, which is what makes the server look at its files.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if presented(address, ca, client) == expected:
            return
        time.sleep(0.2)
    pytest.fail(f"{address} still presents its old certificate:\n{proc.output()}")


def _until_refused(address: str, ca: Path, client: Leaf, proc: ServiceProcess, seen: int) -> bytes:
    """Handshake until the process logged one more refusal of its files; the certificate then."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        presented(address, ca, client)
        if count_events(proc, "tls_files_refused") > seen:
            return presented(address, ca, client)
        time.sleep(0.2)
    pytest.fail(f"{address} never refused its new files:\n{proc.output()}")


def _health_ok(channel: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


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
        install_pair(live, name, leaves["a"][name].cert, leaves["a"][name].key)
    config = write_tls_config(tmp_path, live, ca.path, grpc_fallback=True)  # the AR's rank dials PutKv

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
        generate_image(target, ca.path, client, 1)
        for name in REPLICAS:
            assert presented(procs[name].address, ca.path, client) == leaves["a"][name].der()

        # The new pair in place: new connections get it, the channels up before go on.
        for name in REPLICAS:
            install_pair(live, name, leaves["b"][name].cert, leaves["b"][name].key)
        for name in REPLICAS:
            _until_presented(procs[name].address, ca.path, client, leaves["b"][name].der(), procs[name])
            assert _health_ok(channels[name])
        generate_image(target, ca.path, client, 2)

        # A mismatched pair (generation c's certificate, generation b's key): refused, b kept.
        for name in REPLICAS:
            seen = count_events(procs[name], "tls_files_refused")
            install_pair(live, name, leaves["c"][name].cert, None)  # half-replaced: its key not yet
            assert _until_refused(procs[name].address, ca.path, client, procs[name], seen) == leaves["b"][name].der()
            assert count_events(procs[name], "tls_files_refused") == seen + 1  # one warning, not one per handshake
            assert _health_ok(channels[name])
        generate_image(target, ca.path, client, 3)

        # Its key written after: the pair is consistent again, and taken.
        for name in REPLICAS:
            install_pair(live, name, None, leaves["c"][name].key)
        for name in REPLICAS:
            _until_presented(procs[name].address, ca.path, client, leaves["c"][name].der(), procs[name])
            assert _health_ok(channels[name])
        generate_image(target, ca.path, client, 4)
        # Two pairs taken by each server (the AR's rank, dialling PutKv, watches the files too).
        assert count_events(procs["dit-0"], "tls_files_reloaded") == 2, procs["dit-0"].output()
        assert count_events(procs["ar-0"], "tls_files_reloaded") >= 2, procs["ar-0"].output()
    finally:
        for channel in channels.values():
            channel.close()
        for name in (*REPLICAS, "broker"):
            if name in procs:
                assert procs[name].stop(timeout=30) == 0, procs[name].output()


def _client_rotation(
    tmp_path: Path, server: str, client: str
) -> tuple[TestCa, Leaf, Leaf, Leaf, Path, SecurityConfig, TlsMaterial]:
    """A CA, the pair of `server`, two pairs of `client` (the first installed in `live`, the
    second for the test to install), `client`'s security config and the TLS material read."""
    for sub in ("ca", "a", "b", "live"):
        (tmp_path / sub).mkdir()
    ca = TestCa(tmp_path / "ca")
    server_leaf = ca.issue(server)
    ca.folder = tmp_path / "a"
    first = ca.issue(client)
    ca.folder = tmp_path / "b"
    second = ca.issue(client)
    live = tmp_path / "live"
    install_pair(live, client, first.cert, first.key)
    cfg = SecurityConfig.model_validate(tls_security(live, ca.path, require_client_cert=False))
    tls = read_tls(cfg, client)
    assert tls is not None
    return ca, server_leaf, first, second, live, cfg, tls


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
    ca, server_leaf, first, second, live, cfg, tls = _client_rotation(tmp_path, "dit-0", "ar-0")
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
        install_pair(live, "ar-0", second.cert, second.key)
        put_kv()
        install_pair(live, "ar-0", first.cert, second.key)  # a pair that does not match: refused
        put_kv()
        assert files.refusals == 1
        assert recorder.seen == [first.cert.read_bytes(), second.cert.read_bytes(), second.cert.read_bytes()]
    finally:
        sender.close()
        server.stop(None)


def test_a_broker_channel_dials_again_with_the_replaced_client_certificate_and_lets_calls_finish(
    tmp_path: Path,
) -> None:
    ca, server_leaf, first, second, live, cfg, tls = _client_rotation(tmp_path, "broker", "dit-0")
    certificates = ServerCertificates(tls, CertificateFiles(cfg, "dit-0", tls, check_interval_s=0.0))

    async def scenario() -> None:
        recorder = RecordingServer(server_leaf, ca.path)
        seen = recorder.seen
        await recorder.server.start()
        channel = broker_channel(recorder.target, ChannelSecurity(replica_id="dit-0", tls=tls), certificates)
        try:
            unary = channel.unary_unary("/t.T/Call")
            assert await unary(b"1", timeout=30) == b"1" and seen[-1] == first.cert.read_bytes()
            stream = channel.unary_stream("/t.T/Held")(b"", timeout=60)
            assert await stream.read() == b"started"  # a call in flight on the first channel

            install_pair(live, "dit-0", second.cert, second.key)
            for _ in range(600):  # the files are looked at off the loop: a later call sees the new pair
                assert await unary(b"2", timeout=30) == b"2"
                if seen[-1] == second.cert.read_bytes():
                    break
                await asyncio.sleep(0.05)
            assert seen[-1] == second.cert.read_bytes()
            assert isinstance(channel, RenewingChannel) and channel.renewals == 1
            recorder.release.set()
            assert await stream.read() == b"finished"  # the replaced channel let it finish
            assert await stream.code() == grpc.StatusCode.OK
        finally:
            await channel.close()
            await recorder.server.stop(None)

    asyncio.run(scenario())
