"""The broker's own channels to its replicas (Tokenize, Prefill, Denoise) present the TLS pair
`kvrelay rotate-secrets` reloaded (kvrelay/server_tls.py renewing_dial; docs/operations.md,
Rotating TLS certificates): real `kvrelay broker`, `kvrelay ar` and `kvrelay dit` processes,
mutual TLS on every channel, certificates of two throwaway CAs (tests/security/certs.py).

A CA rotation: everything starts on the old CA's certificates, trusting both CAs; the broker
takes a certificate of the new CA (rotate-secrets); then the replicas restart at their addresses
on new-CA certificates, trusting the new CA only. The broker's channels to them, opened on the
old certificate and kept since, must dial again with the new one: a generation still succeeds,
on its first attempt. Before, they went on presenting the old certificate, which the replicas
refused: the broker could no longer reach them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from kvrelay.client import KvRelayClient
from kvrelay.node.cli import main
from kvrelay.ports import pick_free_port
from kvrelay.security import ChannelCache, ChannelSecurity, TlsMaterial
from kvrelay.server_tls import ServerCertificates, renewing_dial
from tests.procs import ServiceProcess, start_service
from tests.security.certs import (
    Leaf,
    RecordingServer,
    TestCa,
    count_events,
    generate_image,
    install_pair,
    write_tls_config,
)

pytestmark = pytest.mark.usefixtures("no_ambient_tokens")
REPLICAS = ("dit-0", "ar-0")


def _incarnations(target: str, ca: Path, operator: Leaf) -> dict[str, tuple[str, bool]]:
    chain, key = operator.pem()
    with KvRelayClient(target, root_certificates=ca.read_bytes(), certificate_chain=chain, private_key=key) as c:
        registry = c.get_replica_registry(timeout=10)
    return {r.replica_id: (r.incarnation_id, r.up) for r in registry.replicas}


def _until_registered(target: str, ca: Path, operator: Leaf, procs: dict[str, ServiceProcess],
                      before: dict[str, tuple[str, bool]]) -> dict[str, tuple[str, bool]]:  # fmt: skip
    """Until every replica is up with an incarnation not in `before`; the incarnations then."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = _incarnations(target, ca, operator)
        if all(name in now and now[name][1] and now[name] != before.get(name) for name in REPLICAS):
            return now
        time.sleep(0.2)
    pytest.fail(f"the replicas never registered: {now}\n" + procs["broker"].output())


def test_the_broker_channel_cache_dials_again_with_the_pair_rotate_secrets_swapped_in(tmp_path: Path) -> None:
    """The mechanism, in process: a ChannelCache dialling with `renewing_dial` over the broker's
    ServerCertificates (as broker.orchestrator wires it) presents, from its next call on, the
    pair `swap` took (rotate-secrets), on the cached channel, while a call in flight finishes."""
    for sub in ("ca", "a", "b"):
        (tmp_path / sub).mkdir()
    ca = TestCa(tmp_path / "ca")
    replica = ca.issue("ar-0")
    ca.folder = tmp_path / "a"
    first = ca.issue("broker")
    ca.folder = tmp_path / "b"
    second = ca.issue("broker")
    roots = ca.path.read_bytes()
    certificates = ServerCertificates(TlsMaterial(*first.pem(), roots))

    async def scenario() -> None:
        recorder = RecordingServer(replica, ca.path)
        await recorder.server.start()
        cache = ChannelCache(ChannelSecurity(replica_id="broker", tls=certificates.tls), None,
                             renewing_dial(certificates.client_pair(), close_grace_s=60))  # fmt: skip
        try:
            channel = cache.get(recorder.target)
            assert await channel.unary_unary("/t.T/Call")(b"1", timeout=30) == b"1"
            stream = cache.get(recorder.target).unary_stream("/t.T/Held")(b"", timeout=60)
            assert await stream.read() == b"started"  # in flight on the first certificate's channel

            certificates.swap(TlsMaterial(*second.pem(), roots))
            assert cache.get(recorder.target) is channel  # the same cached channel, not forgotten
            assert await channel.unary_unary("/t.T/Call")(b"2", timeout=30) == b"2"
            assert recorder.seen == [first.cert.read_bytes(), second.cert.read_bytes()]
            recorder.release.set()
            assert await stream.read() == b"finished"  # the replaced connection let it finish
            assert await stream.code() == grpc.StatusCode.OK
        finally:
            await cache.close()
            await recorder.server.stop(None)

    asyncio.run(scenario())


@pytest.mark.slow
def test_the_broker_reaches_replicas_that_trust_only_the_new_ca_after_rotate_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for sub in ("old", "new", "old-leaves", "new-leaves", "live"):
        (tmp_path / sub).mkdir()
    old_ca, new_ca = TestCa(tmp_path / "old", name="old CA"), TestCa(tmp_path / "new", name="new CA")
    both = tmp_path / "both-cas.pem"
    both.write_bytes(old_ca.path.read_bytes() + new_ca.path.read_bytes())
    old_ca.folder, new_ca.folder = tmp_path / "old-leaves", tmp_path / "new-leaves"
    old = {name: old_ca.issue(name) for name in (*REPLICAS, "broker")}
    new = {name: new_ca.issue(name) for name in (*REPLICAS, "broker", "alice", "kvrelay-operator")}
    live = tmp_path / "live"
    for name in (*REPLICAS, "broker"):
        install_pair(live, name, old[name].cert, old[name].key)
    # The broker trusts both CAs throughout. The gRPC fallback: the AR's rank dials PutKv, over TLS.
    broker_config = write_tls_config(tmp_path, live, both, name="broker", grpc_fallback=True)
    replica_configs = {"old": write_tls_config(tmp_path, live, both, name="replicas-old", grpc_fallback=True),
                       "new": write_tls_config(tmp_path, live, new_ca.path, name="replicas-new", grpc_fallback=True)}  # fmt: skip
    ports = {name: pick_free_port() for name in REPLICAS}

    procs: dict[str, ServiceProcess] = {}

    def start_replicas(config: Path) -> None:
        for name in REPLICAS:
            procs[name] = start_service(
                [name.split("-")[0], "--config", str(config), "--port", str(ports[name]), "--metrics-port", "0",
                 "--broker", target], cwd=tmp_path, timeout=120,
            )  # fmt: skip

    try:
        procs["broker"] = start_service(
            ["broker", "--config", str(broker_config), "--port", "0", "--metrics-port", "0"], cwd=tmp_path
        )
        target = procs["broker"].address
        start_replicas(replica_configs["old"])
        before = _until_registered(target, both, new["kvrelay-operator"], procs, {})
        # The broker dials each replica (its channels kept from now on), on the old certificate.
        generate_image(target, both, new["alice"], 1)

        install_pair(live, "broker", new["broker"].cert, new["broker"].key)
        capsys.readouterr()
        code = main(["rotate-secrets", "--target", target, "--tls-ca", str(both),
                     "--tls-cert", str(new["kvrelay-operator"].cert), "--tls-key", str(new["kvrelay-operator"].key)])  # fmt: skip
        out, err = capsys.readouterr()
        assert code == 0 and "tls: reloaded" in out, out + err
        generate_image(target, both, new["alice"], 2)  # replicas still trusting both: reached either way

        # The replicas drop the old CA: restarted at their addresses, on new-CA certificates.
        for name in REPLICAS:
            assert procs.pop(name).stop(timeout=30) == 0
            install_pair(live, name, new[name].cert, new[name].key)
        start_replicas(replica_configs["new"])
        _until_registered(target, both, new["kvrelay-operator"], procs, before)
        generate_image(target, both, new["alice"], 3)
        # On its first attempt: no call of the broker's failed to reach a replica.
        assert count_events(procs["broker"], "replica_unreachable") == 0, procs["broker"].output()
    finally:
        for name in (*REPLICAS, "broker"):
            if name in procs:
                assert procs[name].stop(timeout=30) == 0, procs[name].output()
