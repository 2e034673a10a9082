"""Bound replica tokens (security.replica_tokens: bound; docs/operations.md, Per-replica tokens).

With the shared replica token any holder could register a new incarnation under a live replica's
id (the broker then frees the old one's pages) or heartbeat, report and release as another
replica. Bound, each replica's token is HMAC-SHA256 of its id under the broker's secret: the
broker takes it only for that id, a replica takes the broker's call token and the ticket AR's
write token derived from its own, and the shared token opens nothing.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import grpc
import pytest

from kvrelay.broker.authz import broker_checks
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.service import BrokerServicer
from kvrelay.broker.waiters import run_maintenance
from kvrelay.config import SecurityConfig
from kvrelay.errors import reason_of
from kvrelay.security import (
    AUTHORIZATION_METADATA,
    REPLICA_ID_METADATA,
    AuthInterceptor,
    CallerClass,
    ChannelSecurity,
    Credentials,
    SecurityError,
    TlsMaterial,
    broker_call_token,
    load_credentials,
    make_channel,
    node_token_env,
    put_kv_token,
    replica_token_for,
    require_bound_credential,
)
from kvrelay.server import GrpcServer
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.test_grpc import replica

SECRET = "the-brokers-secret-0123456789"
SHARED = "the-old-shared-replica-token"
OPERATOR = "operator-token-89ab"
AR0, DIT0, AR1 = (replica_token_for(SECRET, r) for r in ("ar-0", "dit-0", "ar-1"))
BROKER = Credentials(operator_token=OPERATOR, bound_replica_tokens=True, replica_secret=SECRET,
                     rate_limit_per_second=0.0)  # fmt: skip


def replica_creds(token: str) -> Credentials:
    return Credentials(operator_token=OPERATOR, replica_token=token, bound_replica_tokens=True)


def authenticate(creds: Credentials, token: str, declared: str | None) -> Any:
    metadata = [(AUTHORIZATION_METADATA, f"Bearer {token}")]
    if declared is not None:
        metadata.append((REPLICA_ID_METADATA, declared))
    return AuthInterceptor(creds).authenticate(metadata, {})


# ---------------------------------------------------------------- the tokens and the check


def test_each_token_is_its_ids_and_its_purposes_alone() -> None:
    assert len({AR0, DIT0, AR1}) == 3
    assert replica_token_for(SECRET, "ar-0") == AR0  # derived again, the same: the broker needs no table
    assert replica_token_for(SECRET + "x", "ar-0") != AR0
    # No value doubles as another: a replica's call token, write tokens and its own token differ.
    assert len({DIT0, broker_call_token(DIT0), put_kv_token(DIT0, "ar-0"), put_kv_token(DIT0, "ar-1")}) == 4
    for bad in ("", "broker"):
        with pytest.raises(SecurityError):
            replica_token_for(SECRET, bad)


def test_the_broker_takes_a_token_only_for_its_own_id() -> None:
    ok = authenticate(BROKER, AR0, "ar-0")
    assert CallerClass.REPLICA in ok.classes and ok.replica_id == "ar-0" and not ok.refusal
    for token, declared in ((AR0, "dit-0"), (AR0, "ar-1"), (DIT0, "ar-0"), (SHARED, "ar-0"), (AR0, None),
                            (AR0, "broker"), (broker_call_token(AR0), "broker")):  # fmt: skip
        caller = authenticate(BROKER, token, declared)
        assert CallerClass.REPLICA not in caller.classes and not caller.authenticated, (token, declared)
        assert caller.refusal, (token, declared)
        assert SECRET not in caller.refusal and AR0 not in caller.refusal and DIT0 not in caller.refusal
    # Other caller classes are unchanged.
    assert CallerClass.OPERATOR in authenticate(BROKER, OPERATOR, None).classes


def test_a_replica_takes_the_brokers_call_token_and_its_ars_write_token_only() -> None:
    dit = replica_creds(DIT0)
    broker = authenticate(dit, broker_call_token(DIT0), "broker")
    assert CallerClass.REPLICA in broker.classes and broker.replica_id == "broker"
    writer = authenticate(dit, put_kv_token(DIT0, "ar-0"), "ar-0")
    assert CallerClass.REPLICA in writer.classes and writer.replica_id == "ar-0"
    refused = [
        (broker_call_token(AR0), "broker"),  # the broker's call token of another replica
        (put_kv_token(DIT0, "ar-0"), "ar-1"),  # ar-0's write token, claimed by ar-1
        (put_kv_token(DIT0, "ar-0"), "broker"),  # a write token is not the broker's
        (broker_call_token(DIT0), "ar-0"),  # nor the broker's call token a write token
        (DIT0, "dit-0"),  # its own token: what it presents to the broker, not a credential here
        (AR0, "ar-0"),  # an AR's own token: the DiT would learn it and act as ar-0 at the broker
        (SHARED, "broker"),
    ]
    for token, declared in refused:
        caller = authenticate(dit, token, declared)
        assert CallerClass.REPLICA not in caller.classes and caller.refusal, (token, declared)
        assert DIT0 not in caller.refusal


def test_a_shared_node_certificate_binds_no_id_but_a_replicas_own_certificate_does() -> None:
    tls = TlsMaterial(cert_chain=None, private_key=None, root_certificates=b"", require_client_cert=True)
    broker = replace(BROKER, tls=tls)
    node_cert = {"x509_common_name": [b"kvrelay-node"]}
    interceptor = AuthInterceptor(broker)
    # The node certificate with no token, or with another replica's: not a replica credential.
    for token in ("", AR0):
        caller = interceptor.authenticate([(AUTHORIZATION_METADATA, f"Bearer {token}"),
                                           (REPLICA_ID_METADATA, "dit-0")], node_cert)  # fmt: skip
        assert CallerClass.REPLICA not in caller.classes, token
    # With dit-0's own token it is dit-0.
    caller = interceptor.authenticate([(AUTHORIZATION_METADATA, f"Bearer {DIT0}"), (REPLICA_ID_METADATA, "dit-0")],
                                      node_cert)  # fmt: skip
    assert CallerClass.REPLICA in caller.classes and caller.replica_id == "dit-0"
    # A certificate per replica binds its id by itself, as without bound tokens.
    own = interceptor.authenticate([], {"x509_common_name": [b"dit-0"]})
    assert CallerClass.REPLICA in own.classes and own.replica_id == "dit-0"


def test_credentials_present_bound_tokens_to_each_peer() -> None:
    assert BROKER.broker_channel("dit-0").token == broker_call_token(DIT0)
    assert BROKER.broker_channel("ar-0").token == broker_call_token(AR0)
    assert BROKER.broker_channel("ar-0").replica_id == "broker"
    assert BROKER.write_token("dit-0", "ar-0") == put_kv_token(DIT0, "ar-0")
    # The AR's PutKv channel carries its id only: each call brings the broker's write token.
    assert replica_creds(AR0).put_kv_channel("ar-0") == ChannelSecurity(token=None, replica_id="ar-0")
    shared = Credentials(replica_token=SHARED)
    assert shared.broker_channel("dit-0").token == SHARED and shared.write_token("dit-0", "ar-0") == ""


def test_load_credentials_gives_the_broker_the_secret_and_a_replica_its_token(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRELAY_REPLICA_SECRET", SECRET)
    monkeypatch.setenv("KVRELAY_REPLICA_TOKEN", SHARED)
    (tmp_path / "ar-0.token").write_text(AR0 + "\n")
    cfg = SecurityConfig.model_validate(
        {"replica_tokens": "bound", "replica_token_file": str(tmp_path / "{name}.token")}
    )
    broker = load_credentials(cfg, "broker")
    assert broker.replica_secret == SECRET and broker.replica_token is None and broker.authenticates_replicas
    ar = load_credentials(cfg, "ar-0")
    assert ar.replica_token == AR0 and ar.replica_secret is None
    require_bound_credential(broker, "broker")
    require_bound_credential(ar, "ar-0")
    with pytest.raises(SecurityError, match="replica_token_file: cannot read"):
        load_credentials(cfg, "dit-0")  # no file of its own
    monkeypatch.delenv("KVRELAY_REPLICA_SECRET")
    with pytest.raises(SecurityError, match="replica_secret_env"):
        require_bound_credential(load_credentials(cfg, "broker"), "broker")
    monkeypatch.delenv("KVRELAY_REPLICA_TOKEN")
    unset = SecurityConfig.model_validate({"replica_tokens": "bound"})
    with pytest.raises(SecurityError, match="kvrelay token dit-0"):
        require_bound_credential(load_credentials(unset, "dit-0"), "dit-0")


def test_a_node_gives_each_child_its_own_token_and_only_the_broker_the_secret(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = SecurityConfig.model_validate({"replica_tokens": "bound"})
    names = ["broker", "ar-0", "dit-0"]
    monkeypatch.setenv("KVRELAY_REPLICA_SECRET", SECRET)
    env = node_token_env(cfg, names)
    # Nor the api and operator tokens of the node's environment: found black-box, every AR and DiT
    # child of `kvrelay up` held $KVRELAY_OPERATOR_TOKEN (/proc/PID/environ), so whoever took over
    # one replica could forget, deregister or cancel anything as an operator.
    blanked = {"KVRELAY_REPLICA_SECRET": "", "KVRELAY_API_TOKEN": "", "KVRELAY_OPERATOR_TOKEN": ""}
    assert env["ar-0"] == {**blanked, "KVRELAY_REPLICA_TOKEN": AR0}
    assert env["dit-0"] == {**blanked, "KVRELAY_REPLICA_TOKEN": DIT0}
    assert env["broker"] == {}  # it has the node's own
    renamed = SecurityConfig.model_validate({"replica_tokens": "bound", "api_token_env": "API", "operator_token_env": "OPS"})
    assert node_token_env(renamed, names)["ar-0"] == {
        "KVRELAY_REPLICA_SECRET": "", "API": "", "OPS": "", "KVRELAY_REPLICA_TOKEN": AR0
    }
    # No secret set: one is made for the node, given to the broker, and the tokens derive from it.
    monkeypatch.delenv("KVRELAY_REPLICA_SECRET")
    env = node_token_env(cfg, names, make_secret=lambda: "made-up")
    assert env["broker"] == {"KVRELAY_REPLICA_SECRET": "made-up"}
    assert env["ar-0"]["KVRELAY_REPLICA_TOKEN"] == replica_token_for("made-up", "ar-0")
    assert node_token_env(SecurityConfig.model_validate({}), names) == {}
    # Never a made-up secret where tokens must match a broker's real one: token files, or a node
    # of replicas alone (its broker runs elsewhere).
    with pytest.raises(SecurityError, match="replica_token_file"):
        node_token_env(SecurityConfig.model_validate({"replica_tokens": "bound", "replica_token_file": "{name}.t"}),
                       names, make_secret=lambda: "made-up")  # fmt: skip
    with pytest.raises(SecurityError, match="broker elsewhere"):
        node_token_env(cfg, ["ar-0", "dit-0"], make_secret=lambda: "made-up")


# ---------------------------------------------------------------- a broker on a real socket


async def _code(address: str, token: str, declared: str | None, call: str, request: Any) -> tuple[str, str, str]:
    async with make_channel(address, ChannelSecurity(token=token, replica_id=declared)) as channel:
        try:
            await getattr(broker_pb2_grpc.BrokerServiceStub(channel), call)(request, timeout=10)
        except grpc.aio.AioRpcError as err:
            return reason_of(err)
    return "OK", "", ""


def test_the_broker_refuses_a_replica_token_of_another_id_and_the_victim_keeps_its_pages(tmp_path: Any) -> None:
    async def scenario() -> None:
        core = BrokerCore(tmp_path / "journal.sqlite", lease_seconds=600.0, drain_quiet_seconds=0.05)
        server = GrpcServer(
            name="broker", host="127.0.0.1", port=0, credentials=BROKER, checks=broker_checks(core),
            registrations=[(broker_pb2_grpc.add_BrokerServiceServicer_to_server, BrokerServicer(core, 5.0),
                            "kvrelay.v1.BrokerService")],
        )  # fmt: skip
        await server.start()
        maintenance = asyncio.create_task(run_maintenance(core, 0.05))
        address = server.address
        try:
            for replica_id, token, role, pages in (("ar-0", AR0, common_pb2.REPLICA_ROLE_AR, 0),
                                                   ("dit-0", DIT0, common_pb2.REPLICA_ROLE_DIT, 16)):  # fmt: skip
                register = broker_pb2.RegisterReplicaRequest(replica=replica(replica_id, role, num_pages=pages))
                assert await _code(address, token, replica_id, "RegisterReplica", register) == ("OK", "", "")
            async with make_channel(address, ChannelSecurity(token=OPERATOR)) as channel:
                created = await broker_pb2_grpc.BrokerServiceStub(channel).CreateTicket(broker_pb2.CreateTicketRequest(
                    request_id="r1", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[40]), timeout=10)
            ticket_id = created.ticket.ticket_id
            reserve = broker_pb2.ReserveTicketRequest(ticket_id=ticket_id, ar_replica_id="ar-0",
                                                      incarnation_id="ar-0-inc-1")  # fmt: skip
            assert (await _code(address, AR0, "ar-0", "ReserveTicket", reserve))[0] == "OK"
            before = (core.get_replica("dit-0").spec.incarnation_id, core.get_ticket(ticket_id).state,
                      core.free_pages("dit-0"))  # fmt: skip

            as_dit = {
                "RegisterReplica": broker_pb2.RegisterReplicaRequest(replica=broker_pb2.ReplicaInfo(
                    **{**_fields(replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16)),
                       "incarnation_id": "dit-0-impostor"})),
                "Heartbeat": broker_pb2.HeartbeatRequest(replica_id="dit-0", incarnation_id="dit-0-inc-1"),
                "ReleaseTicket": broker_pb2.ReleaseTicketRequest(
                    ticket_id=ticket_id, outcome=broker_pb2.TICKET_OUTCOME_OK, replica_id="dit-0",
                    incarnation_id="dit-0-inc-1"),
                "StartConsuming": broker_pb2.StartConsumingRequest(ticket_id=ticket_id, replica_id="dit-0",
                                                                   incarnation_id="dit-0-inc-1"),
                "ReportLoad": broker_pb2.ReportLoadRequest(ticket_id=ticket_id, replica_id="dit-0",
                                                           incarnation_id="dit-0-inc-1"),
                "DeregisterReplica": broker_pb2.DeregisterReplicaRequest(replica_id="dit-0",
                                                                         incarnation_id="dit-0-inc-1"),
            }  # fmt: skip
            report = broker_pb2.ReportWriteRequest(
                ticket_id=ticket_id, row=0, replica_id="ar-0", incarnation_id="ar-0-inc-1",
                status=common_pb2.WRITE_STATUS_FAILED, message="impostor")  # fmt: skip
            attempts = [(AR0, "dit-0", call, request) for call, request in as_dit.items()]
            attempts += [(SHARED, "dit-0", call, request) for call, request in as_dit.items()]
            attempts += [(DIT0, "ar-0", "ReportWrite", report), (AR1, "ar-0", "ReportWrite", report),
                         (SHARED, "ar-0", "ReportWrite", report), (AR0, None, "Heartbeat", as_dit["Heartbeat"])]
            for token, declared, call, request in attempts:
                code, reason, message = await _code(address, token, declared, call, request)
                assert (code, reason) == ("UNAUTHENTICATED", "REPLICA_TOKEN_MISMATCH"), (call, declared, message)
                assert SECRET not in message and token not in message
            # Its own token, another id in the request: the ownership check, as before.
            code, _, _ = await _code(address, AR0, "ar-0", "Heartbeat", as_dit["Heartbeat"])
            assert code == "PERMISSION_DENIED"
            after = (core.get_replica("dit-0").spec.incarnation_id, core.get_ticket(ticket_id).state,
                     core.free_pages("dit-0"))  # fmt: skip
            assert after == before
            # dit-0 itself still acts as itself.
            assert (await _code(address, DIT0, "dit-0", "Heartbeat", as_dit["Heartbeat"]))[0] == "OK"
        finally:
            await server.stop(0.5)
            maintenance.cancel()
            core.close()

    asyncio.run(scenario())


def _fields(message: Any) -> dict[str, Any]:
    return {fd.name: value for fd, value in message.ListFields()}


# ---------------------------------------------------------------- every replica RPC of every server


def _ident(b: bytes) -> bytes:
    return b


async def _raw_call(address: str, path: str, method: Any, security: ChannelSecurity) -> tuple[str, str]:
    """(code, reason) of one call with an empty request (`OK`, "" when it answered)."""
    async with make_channel(address, security) as channel:
        try:
            if method.client_streaming and method.server_streaming:
                stream = channel.stream_stream(path, _ident, _ident)(iter([b""]), timeout=5)
                await stream.read()
                stream.cancel()
            elif method.client_streaming:
                await channel.stream_unary(path, _ident, _ident)(iter([b""]), timeout=5)
            elif method.server_streaming:
                stream = channel.unary_stream(path, _ident, _ident)(b"", timeout=5)
                await stream.read()
                stream.cancel()
            else:
                await channel.unary_unary(path, _ident, _ident)(b"", timeout=5)
        except grpc.aio.AioRpcError as err:
            code, reason, _ = reason_of(err)
            return code, reason
    return "OK", ""


def test_every_replica_rpc_of_every_server_refuses_another_replicas_credential(tmp_path: Any) -> None:
    from prometheus_client import CollectorRegistry

    from kvrelay.ar_service.service import ArMetrics, ArServicer
    from kvrelay.dit_service.service import DitServicer
    from kvrelay.security import RPC_RULES
    from kvrelay.v1 import ar_pb2, ar_pb2_grpc, dit_pb2, dit_pb2_grpc

    services = {
        "broker": broker_pb2.DESCRIPTOR.services_by_name["BrokerService"],
        "ar-0": ar_pb2.DESCRIPTOR.services_by_name["ArService"],
        "dit-0": dit_pb2.DESCRIPTOR.services_by_name["DitService"],
    }
    # Per server: credentials of others that must not open its replica RPCs, and the one that does.
    refused = {
        "broker": [(AR0, "dit-0"), (SHARED, "ar-0"), (DIT0, None), (broker_call_token(AR0), "broker")],
        "ar-0": [(broker_call_token(DIT0), "broker"), (AR0, "broker"), (AR0, "ar-0"), (SHARED, "broker")],
        "dit-0": [(broker_call_token(AR0), "broker"), (put_kv_token(DIT0, "ar-0"), "ar-1"),
                  (put_kv_token(replica_token_for(SECRET, "dit-1"), "ar-0"), "ar-0"), (DIT0, "dit-0")],
    }  # fmt: skip
    admitted = {"broker": (DIT0, "dit-0"), "ar-0": (broker_call_token(AR0), "broker"),
                "dit-0": (broker_call_token(DIT0), "broker")}  # fmt: skip

    async def scenario() -> None:
        core = BrokerCore(tmp_path / "journal.sqlite", lease_seconds=600.0, drain_quiet_seconds=0.05)
        servers = {
            "broker": GrpcServer(
                name="broker", host="127.0.0.1", port=0, credentials=BROKER, checks=broker_checks(core),
                registrations=[(broker_pb2_grpc.add_BrokerServiceServicer_to_server, BrokerServicer(core, 5.0),
                                "kvrelay.v1.BrokerService")]),
            "ar-0": GrpcServer(
                name="ar-0", host="127.0.0.1", port=0, credentials=replica_creds(AR0),
                registrations=[(ar_pb2_grpc.add_ArServiceServicer_to_server,
                                ArServicer(None, ArMetrics.create(CollectorRegistry()), lambda reason: None),
                                "kvrelay.v1.ArService")]),
            "dit-0": GrpcServer(
                name="dit-0", host="127.0.0.1", port=0, credentials=replica_creds(DIT0),
                registrations=[(dit_pb2_grpc.add_DitServiceServicer_to_server, DitServicer(),
                                "kvrelay.v1.DitService")]),
        }  # fmt: skip
        for server in servers.values():
            await server.start()
        try:
            checked = 0
            for name, service in services.items():
                for method in service.methods:
                    path = f"/{service.full_name}/{method.name}"
                    if RPC_RULES[path].caller_class is not CallerClass.REPLICA:
                        continue
                    for token, declared in refused[name]:
                        got = await _raw_call(servers[name].address, path, method, ChannelSecurity(token, declared))
                        assert got == ("UNAUTHENTICATED", "REPLICA_TOKEN_MISMATCH"), (name, path, declared, got)
                        checked += 1
                    token, declared = admitted[name]
                    if method.name == "PutKv":
                        token, declared = put_kv_token(DIT0, "ar-0"), "ar-0"  # the ticket AR's write token
                    code, _ = await _raw_call(servers[name].address, path, method, ChannelSecurity(token, declared))
                    assert code not in ("UNAUTHENTICATED", "PERMISSION_DENIED"), (name, path, code)
            assert checked >= 4 * 11 + 4 * 2 + 4 * 2  # every replica RPC of BrokerService, ArService, DitService
        finally:
            for server in servers.values():
                await server.stop(0.5)
            core.close()

    asyncio.run(scenario())


def test_kvrelay_status_under_bound_tokens_takes_the_operator_token_and_no_replicas(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator path is the operator token's, bound mode or not: `kvrelay status` (ListReplicas,
    GetPool, ListTickets) with it lists the replicas and says that replicas authenticate with
    bound tokens (what an operator checks after turning them on); a replica's own bound token (the
    one token a replica host holds) and the old shared one read nothing."""
    from kvrelay.broker.service import replica_authentication
    from kvrelay.node.cli import main

    monkeypatch.delenv("KVRELAY_OPERATOR_TOKEN", raising=False)
    monkeypatch.delenv("KVRELAY_API_TOKEN", raising=False)

    def status(address: str, token: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["status", "--target", address, "--json", "--token", token])
        out, err = capsys.readouterr()
        return code, out, err

    async def scenario() -> None:
        core = BrokerCore(tmp_path / "journal.sqlite", lease_seconds=600.0)
        server = GrpcServer(
            name="broker", host="127.0.0.1", port=0, credentials=BROKER, checks=broker_checks(core),
            registrations=[(broker_pb2_grpc.add_BrokerServiceServicer_to_server,
                            BrokerServicer(core, 5.0, replica_authentication=replica_authentication(BROKER)),
                            "kvrelay.v1.BrokerService")],
        )  # fmt: skip
        await server.start()
        try:
            register = broker_pb2.RegisterReplicaRequest(replica=replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16))
            assert await _code(server.address, DIT0, "dit-0", "RegisterReplica", register) == ("OK", "", "")
            code, out, err = await asyncio.to_thread(status, server.address, OPERATOR)
            assert code == 0, err
            assert [r["replica_id"] for r in json.loads(out)["replicas"]] == ["dit-0"]
            assert [p["replica_id"] for p in json.loads(out)["pools"]] == ["dit-0"]
            assert json.loads(out)["replica_authentication"] == "bound replica tokens"
            human = await asyncio.to_thread(main, ["status", "--target", server.address, "--token", OPERATOR])
            assert human == 0 and "replicas authenticate with: bound replica tokens\n" in capsys.readouterr().out
            for token in (DIT0, SHARED):
                code, out, err = await asyncio.to_thread(status, server.address, token)
                assert (code, out) == (1, "") and "kvrelay status: UNAUTHENTICATED" in err, err
        finally:
            await server.stop(0)
            core.close()

    asyncio.run(scenario())


def test_status_says_how_the_broker_authenticates_replicas_and_never_a_secret() -> None:
    from kvrelay.broker.service import replica_authentication

    tls = TlsMaterial(cert_chain=b"cert", private_key=b"key", root_certificates=b"ca", require_client_cert=True)
    said = {
        "dev": replica_authentication(Credentials()),
        "shared": replica_authentication(Credentials(replica_token=SHARED, operator_token=OPERATOR)),
        "bound": replica_authentication(BROKER),
        "mtls": replica_authentication(Credentials(tls=tls)),
        "server tls, shared": replica_authentication(Credentials(replica_token=SHARED, tls=replace(tls, require_client_cert=False))),
        "shared+mtls": replica_authentication(Credentials(replica_token=SHARED, tls=tls)),
        "bound+mtls": replica_authentication(replace(BROKER, tls=tls)),
        "bound replica": replica_authentication(replica_creds(DIT0)),
    }
    assert said == {
        "dev": "none (development: every caller trusted)",
        "shared": "the shared replica token",
        "bound": "bound replica tokens",
        "mtls": "client certificates",
        "server tls, shared": "the shared replica token",
        "shared+mtls": "the shared replica token or client certificates",
        "bound+mtls": "bound replica tokens or client certificates",
        "bound replica": "bound replica tokens",
    }
    assert not any(secret in text for text in said.values() for secret in (SECRET, SHARED, OPERATOR, DIT0))


def test_a_replica_refuses_an_api_or_operator_token_saying_what_it_takes(tmp_path: Any) -> None:
    """An AR or DiT with bound tokens holds no api or operator token (node_token_env blanks them):
    one presented on its RPCs is refused as REPLICA_TOKEN_MISMATCH with a message that says the
    token is not accepted there and which credential is (not "declare an id", which no id fixes),
    echoing no token. The broker's message for a token without an id still says to declare it."""
    from prometheus_client import CollectorRegistry

    from kvrelay.ar_service.service import ArMetrics, ArServicer
    from kvrelay.dit_service.service import DitServicer
    from kvrelay.v1 import ar_pb2, ar_pb2_grpc, dit_pb2, dit_pb2_grpc

    api = "api-token-4567"
    deployed = {name: Credentials(replica_token=token, bound_replica_tokens=True)  # as a node starts them
                for name, token in (("ar-0", AR0), ("dit-0", DIT0))}  # fmt: skip
    broker = replace(BROKER, api_token=api)

    async def refused(address: str, path: str, method: Any, token: str, declared: str | None) -> tuple[str, str, str]:
        async with make_channel(address, ChannelSecurity(token, declared)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                if method.client_streaming:
                    await channel.stream_unary(path, _ident, _ident)(iter([b""]), timeout=5)
                elif method.server_streaming:
                    await channel.unary_stream(path, _ident, _ident)(b"", timeout=5).read()
                else:
                    await channel.unary_unary(path, _ident, _ident)(b"", timeout=5)
        return reason_of(info.value)

    async def scenario() -> None:
        core = BrokerCore(tmp_path / "journal.sqlite", lease_seconds=600.0, drain_quiet_seconds=0.05)
        servers = {
            "broker": GrpcServer(
                name="broker", host="127.0.0.1", port=0, credentials=broker, checks=broker_checks(core),
                registrations=[(broker_pb2_grpc.add_BrokerServiceServicer_to_server, BrokerServicer(core, 5.0),
                                "kvrelay.v1.BrokerService")]),
            "ar-0": GrpcServer(
                name="ar-0", host="127.0.0.1", port=0, credentials=deployed["ar-0"],
                registrations=[(ar_pb2_grpc.add_ArServiceServicer_to_server,
                                ArServicer(None, ArMetrics.create(CollectorRegistry()), lambda reason: None),
                                "kvrelay.v1.ArService")]),
            "dit-0": GrpcServer(
                name="dit-0", host="127.0.0.1", port=0, credentials=deployed["dit-0"],
                registrations=[(dit_pb2_grpc.add_DitServiceServicer_to_server, DitServicer(),
                                "kvrelay.v1.DitService")]),
        }  # fmt: skip
        for server in servers.values():
            await server.start()
        try:
            for name, service in (("ar-0", ar_pb2.DESCRIPTOR.services_by_name["ArService"]),
                                  ("dit-0", dit_pb2.DESCRIPTOR.services_by_name["DitService"])):  # fmt: skip
                for method in service.methods:
                    path = f"/{service.full_name}/{method.name}"
                    for token in (api, OPERATOR):
                        code, reason, message = await refused(servers[name].address, path, method, token, None)
                        assert (code, reason) == ("UNAUTHENTICATED", "REPLICA_TOKEN_MISMATCH"), (name, path, message)
                        assert "is not accepted on a replica RPC of this replica" in message, message
                        assert "takes only the broker's call token (kvrelay-replica-id: broker)" in message, message
                        assert "declare" not in message and token not in message, message
            # The broker: a replica's own token without its id is a mismatch that declaring the id fixes.
            register = broker_pb2.DESCRIPTOR.services_by_name["BrokerService"].methods_by_name["RegisterReplica"]
            code, reason, message = await refused(servers["broker"].address, "/kvrelay.v1.BrokerService/"
                                                  "RegisterReplica", register, DIT0, None)  # fmt: skip
            assert (code, reason) == ("UNAUTHENTICATED", "REPLICA_TOKEN_MISMATCH"), message
            assert "without kvrelay-replica-id" in message and "id declared" in message and DIT0 not in message
            # An api token the broker knows is a credential, just not a replica's: PERMISSION_DENIED.
            code, _, message = await refused(servers["broker"].address, "/kvrelay.v1.BrokerService/RegisterReplica",
                                             register, api, None)  # fmt: skip
            assert code == "PERMISSION_DENIED" and "needs a replica" in message and api not in message, message
        finally:
            for server in servers.values():
                await server.stop(0.5)
            core.close()

    asyncio.run(scenario())
