"""Caller classes on real sockets: who may call what, with which credential (docs/operations.md,
Security). The issue's report first: an anonymous DeregisterReplica must not take a replica out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvrelay.config import ConfigError, parse_config
from kvrelay.errors import reason_of
from kvrelay.security import (
    CallerClass,
    ChannelSecurity,
    Credentials,
    SecurityError,
    check_bind,
    load_credentials,
)
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.security.harness import API, CREDENTIALS, OPERATOR, REPLICA, SecuredDeployment, secured_deployment


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredDeployment]:
    with secured_deployment(tmp_path_factory.mktemp("secured")) as d:
        yield d


def _code(deployment: SecuredDeployment, security: ChannelSecurity | None, call: str, request: object,
          service: str = "broker") -> tuple[str, str]:  # fmt: skip
    with deployment.channel("broker", security) as channel:
        stub = (broker_pb2_grpc.BrokerServiceStub if service == "broker" else generation_pb2_grpc.GenerationServiceStub)(
            channel
        )  # type: ignore[no-untyped-call]
        try:
            getattr(stub, call)(request, timeout=10)
        except grpc.RpcError as err:
            code, reason, _ = reason_of(err)
            return code, reason
    return "OK", ""


def test_anonymous_deregister_does_not_take_a_replica_out(deployment: SecuredDeployment) -> None:
    before = deployment.snapshot()
    request = broker_pb2.DeregisterReplicaRequest(replica_id="dit-0", incarnation_id="dit-0-inc-1")
    assert _code(deployment, None, "DeregisterReplica", request) == ("UNAUTHENTICATED", "UNAUTHENTICATED")
    wrong_token = ChannelSecurity(token="not-the-token", replica_id="dit-0")
    assert _code(deployment, wrong_token, "DeregisterReplica", request)[0] == "UNAUTHENTICATED"
    # The api token is a client's, not a replica's.
    assert _code(deployment, ChannelSecurity(token=API), "DeregisterReplica", request)[0] == "PERMISSION_DENIED"
    # Another replica (the replica token, its own id) may not deregister dit-0 either.
    other = CREDENTIALS.channel(CallerClass.REPLICA, "ar-1")
    assert _code(deployment, other, "DeregisterReplica", request)[0] == "PERMISSION_DENIED"
    assert deployment.snapshot() == before


def test_a_replica_acts_only_on_its_own_id_and_tickets(deployment: SecuredDeployment) -> None:
    before = deployment.snapshot()
    ar1 = CREDENTIALS.channel(CallerClass.REPLICA, "ar-1")
    heartbeat = broker_pb2.HeartbeatRequest(replica_id="ar-0", incarnation_id="ar-0-inc-1")
    assert _code(deployment, ar1, "Heartbeat", heartbeat)[0] == "PERMISSION_DENIED"
    # Its own heartbeat goes through.
    own = broker_pb2.HeartbeatRequest(replica_id="ar-1", incarnation_id="ar-1-inc-1")
    assert _code(deployment, ar1, "Heartbeat", own) == ("OK", "")
    # No empty-id bypass of the owner check on ReleaseTicket.
    release = broker_pb2.ReleaseTicketRequest(ticket_id="t", outcome=broker_pb2.TICKET_OUTCOME_OK)
    assert _code(deployment, ar1, "ReleaseTicket", release) == ("INVALID_ARGUMENT", "MISSING_FIELD")
    # Operator RPCs: not for replicas.
    create = broker_pb2.CreateTicketRequest(
        request_id="r", ar_replica_id="ar-1", dit_replica_id="dit-0", row_token_counts=[4]
    )
    operator_calls = [
        ("ListReplicas", broker_pb2.ListReplicasRequest()),
        ("GetPool", broker_pb2.GetPoolRequest()),
        ("CreateTicket", create),
    ]
    for call, request in operator_calls:
        assert _code(deployment, ar1, call, request)[0] == "PERMISSION_DENIED", call
    # A replica token without a declared id acts as nobody.
    assert _code(deployment, ChannelSecurity(token=REPLICA), "Heartbeat", own)[0] == "PERMISSION_DENIED"
    assert deployment.snapshot() == before


def test_operator_and_api_tokens(deployment: SecuredDeployment) -> None:
    operator = ChannelSecurity(token=OPERATOR)
    assert _code(deployment, operator, "ListReplicas", broker_pb2.ListReplicasRequest()) == ("OK", "")
    api = ChannelSecurity(token=API)
    assert _code(deployment, api, "ListReplicas", broker_pb2.ListReplicasRequest())[0] == "PERMISSION_DENIED"
    # ListGenerations is public (DESIGN), but the listing names a request_id (the capability of
    # Get/CancelGeneration) and prompts only to an operator (found black-box: list, then
    # GetGeneration of another client's id returned its image); test_generation_api checks the
    # redaction itself.
    listing = generation_pb2.ListGenerationsRequest()
    assert _code(deployment, api, "ListGenerations", listing, service="generation") == ("OK", "")
    assert _code(deployment, operator, "ListGenerations", listing, service="generation") == ("OK", "")
    assert _code(deployment, None, "ListGenerations", listing, service="generation")[0] == "UNAUTHENTICATED"
    # A replica credential is not a client's when the deployment sets an api token.
    replica = CREDENTIALS.channel(CallerClass.REPLICA, "ar-1")
    assert _code(deployment, replica, "ListGenerations", listing, service="generation")[0] == "PERMISSION_DENIED"


def test_a_ticket_made_over_create_ticket_expires(deployment: SecuredDeployment) -> None:
    import time

    operator = ChannelSecurity(token=OPERATOR)
    with deployment.channel("broker", operator) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)  # type: ignore[no-untyped-call]
        ticket = stub.CreateTicket(broker_pb2.CreateTicketRequest(
            request_id="debug-1", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[20]), timeout=10,
        ).ticket  # fmt: skip
        assert ticket.state == broker_pb2.TICKET_STATE_RESERVED
        # The harness gives CreateTicket tickets 5 s (the broker: the stages' request timeout).
        deadline = time.monotonic() + 20
        while stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id=ticket.ticket_id), timeout=10).ticket.state != (
            broker_pb2.TICKET_STATE_RELEASED
        ):
            assert time.monotonic() < deadline, "a CreateTicket ticket held its pages past its TTL"
            time.sleep(0.1)
        pool = stub.GetPool(broker_pb2.GetPoolRequest(replica_id="dit-0"), timeout=10).pools[0]
        assert pool.free_pages == pool.total_pages


def test_non_loopback_bind_needs_a_credential() -> None:
    check_bind("127.0.0.1", Credentials(), False, "t")
    check_bind("::1", Credentials(), False, "t")
    with pytest.raises(SecurityError, match="--insecure-bind"):
        check_bind("0.0.0.0", Credentials(), False, "t")
    check_bind("0.0.0.0", Credentials(), True, "t")
    check_bind("0.0.0.0", Credentials(replica_token="x"), False, "t")


def test_security_config_errors_name_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from tests.security.harness import REPO

    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["broker"]["api_token"] = "literal"
    with pytest.raises(ConfigError, match="broker.api_token moved to security.api_token_env"):
        parse_config(data)
    del data["broker"]["api_token"]
    data["security"] = {"replica_token_file": str(tmp_path / "missing")}
    with pytest.raises(SecurityError, match="security.replica_token_file"):
        load_credentials(parse_config(data).security)
    data["security"] = {"api_token_env": "SEC_TEST_API"}
    monkeypatch.setenv("SEC_TEST_API", "x")
    monkeypatch.delenv("KVRELAY_REPLICA_TOKEN", raising=False)
    with pytest.raises(SecurityError, match="security.replica_token_env"):
        load_credentials(parse_config(data).security)
    data["security"] = {"tls": {"cert_file": "a", "key_file": "b"}}
    with pytest.raises(ConfigError, match="security.tls.ca_file"):
        parse_config(data)


def test_kvrelay_broker_refuses_a_public_bind_without_credentials(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.security.harness import REPO

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_") or k == "KVRELAY_LOG_FORMAT"}
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay", "broker", "--config", str(REPO / "tests/configs/test-fast.yaml"),
         "--host", "0.0.0.0", "--port", "0", "--metrics-port", "0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert "--insecure-bind" in out.stderr and "0.0.0.0" in out.stderr


def test_rate_and_size_limits_on_a_kvrelay_server() -> None:
    import asyncio

    from grpc_health.v1 import health_pb2

    from kvrelay.security import RPC_RULES, RpcRule, make_channel
    from tests.security.stub_server import stub_server

    echo = "test.Echo"
    creds = Credentials(replica_token="r", rate_limit_per_second=0.5, rate_limit_burst=2,
                        max_request_bytes=64 * 1024)  # fmt: skip
    rules = {**RPC_RULES, f"/{echo}/Unary": RpcRule(CallerClass.REPLICA, False, "none")}

    async def body() -> None:
        async with (
            stub_server(creds, {echo: ("Unary",)}, rules=rules, name="limits") as address,
            make_channel(address, ChannelSecurity(token="r"), max_request_bytes=1 << 20) as ch,
        ):
            call = ch.unary_unary(f"/{echo}/Unary")
            big = health_pb2.HealthCheckRequest(service="x" * (100 * 1024)).SerializeToString()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(big, timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            small = health_pb2.HealthCheckRequest(service="ok").SerializeToString()
            await call(small, timeout=5)
            await call(small, timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(small, timeout=5)
            assert reason_of(err.value)[:2] == ("RESOURCE_EXHAUSTED", "RATE_LIMITED")

    asyncio.run(body())


def test_client_certificate_names_decide_the_caller() -> None:
    from kvrelay.errors import KvRelayServerError
    from kvrelay.security import AuthInterceptor, TlsMaterial

    tls = TlsMaterial(cert_chain=b"", private_key=b"", root_certificates=b"", require_client_cert=True)
    auth = AuthInterceptor(Credentials(api_token="api", tls=tls))

    def who(cn: str, declared: str | None = None) -> tuple[set[str], str | None]:
        metadata = [("kvrelay-replica-id", declared)] if declared else []
        caller = auth.authenticate(metadata, {"x509_common_name": [cn.encode()]})
        return {c.value for c in caller.classes}, caller.replica_id

    assert who("ar-0") == ({"replica"}, "ar-0")  # a per-replica certificate binds the id
    with pytest.raises(KvRelayServerError, match="differs from the certificate"):
        who("ar-0", declared="dit-0")
    assert who("kvrelay-node", declared="dit-0") == ({"replica"}, "dit-0")  # shared node certificate
    assert who("kvrelay-operator") == ({"operator", "public"}, None)
    assert who("alice") == ({"public"}, None)  # any other certificate of the CA: a client
    anonymous = auth.authenticate([], {})
    assert not anonymous.authenticated and anonymous.classes == frozenset()


def test_the_bearer_scheme_is_case_insensitive() -> None:
    """RFC 7235: the auth-scheme is case-insensitive; `authorization: bearer <token>` (as curl,
    grpcurl users and many HTTP libraries write it) is the same credential as `Bearer <token>`."""
    from kvrelay.security import AuthInterceptor

    auth = AuthInterceptor(Credentials(api_token="api", replica_token="rep", operator_token="op"))

    def classes(value: str) -> set[str]:
        caller = auth.authenticate([("authorization", value)], {})
        return {c.value for c in caller.classes} if caller.authenticated else set()

    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        assert classes(f"{scheme} op") == {"operator", "public"}
        assert classes(f"{scheme} rep") == {"replica"}
        assert classes(f"{scheme}   api") == {"public"}  # extra spaces before the token (RFC 7235: 1*SP)
    # Anything else is still no credential.
    for value in ("op", "Basic op", "Bearerop", "Bearer", "Bearer ", "Bearer op2", "Token op"):
        assert classes(value) == set()


def test_a_stream_dropped_at_a_yield_closes_its_handler_with_the_caller_bound() -> None:
    """A client that goes away while a streaming handler waits at a `yield` (as `kvrelay up`'s
    broker saw for every Generate/WatchTicket whose client left early): grpc abandons the handler
    and the loop finalises the interceptor's generator in a task of its own, in another context.
    That must neither raise (it logged `Task exception was never retrieved ... ValueError ... created
    in a different Context` at error level) nor leave the handler's cleanup to the garbage collector:
    the handler is closed then, with its caller still visible."""
    import asyncio
    import gc

    from grpc_health.v1 import health_pb2

    from kvrelay.security import RPC_RULES, RpcRule, current_caller, make_channel
    from kvrelay.server import GrpcServer

    echo = "test.Echo"
    closed: list[str | None] = []
    errors: list[dict[str, object]] = []

    async def stream(request: health_pb2.HealthCheckRequest, context: object) -> object:
        try:
            while True:
                # Never waits inside the handler: grpc is in its send when the client leaves.
                yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        finally:
            caller = current_caller()
            closed.append(caller.replica_id if caller is not None else None)

    def add(_: object, server: grpc.aio.Server) -> None:
        handler = grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )  # fmt: skip
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(echo, {"Stream": handler}),))

    rules = {**RPC_RULES, f"/{echo}/Stream": RpcRule(CallerClass.REPLICA, False, "none")}

    async def body() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        server = GrpcServer("drop", "127.0.0.1", 0, [(add, None, echo)], credentials=Credentials(replica_token="r"),
                            rules=rules)  # fmt: skip
        await server.start()
        try:
            for _ in range(5):
                async with make_channel(server.address, ChannelSecurity(token="r", replica_id="ar-0")) as ch:
                    call = ch.unary_stream(f"/{echo}/Stream")(
                        health_pb2.HealthCheckRequest().SerializeToString(), timeout=5
                    )
                    await call.read()
                    call.cancel()
                await asyncio.sleep(0.2)
            for _ in range(50):
                gc.collect()
                await asyncio.sleep(0.02)
                if len(closed) == 5:
                    break
        finally:
            await server.stop(0.1)

    asyncio.run(body())
    # Only a handler's own failures: grpc's poller may report unrelated EAGAINs to the handler.
    failed = [str(e.get("exception")) for e in errors if "never retrieved" in str(e.get("message"))]
    assert failed == []
    assert closed == ["ar-0"] * 5


def test_a_token_or_secret_no_server_can_compare_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found black-box: `KVRELAY_OPERATOR_TOKEN` holding the byte 0xff (Python sees a lone
    surrogate) let `kvrelay broker` start SERVING, then every authenticated RPC, Generate included,
    failed UNKNOWN with a UnicodeEncodeError traceback. A token is printable ASCII (an authorization
    header) and the bound-token secret UTF-8 text: anything else is refused at start, naming where."""
    import os
    import subprocess
    import sys

    from kvrelay.config import SecurityConfig
    from tests.security.harness import REPO

    for name in (
        "KVRELAY_API_TOKEN",
        "KVRELAY_OPERATOR_TOKEN",
        "KVRELAY_REPLICA_TOKEN",
        "KVRELAY_REPLICA_SECRET",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVRELAY_REPLICA_TOKEN", "replica-token")
    monkeypatch.setenv("KVRELAY_OPERATOR_TOKEN", "op\udcff")
    with pytest.raises(SecurityError, match=r"security.operator_token_env \(\$KVRELAY_OPERATOR_TOKEN\)"):
        load_credentials(SecurityConfig.model_validate({}))
    monkeypatch.setenv("KVRELAY_OPERATOR_TOKEN", "op\u00e9")  # UTF-8, but no header carries it
    with pytest.raises(SecurityError, match="printable ASCII"):
        load_credentials(SecurityConfig.model_validate({}))
    monkeypatch.setenv("KVRELAY_OPERATOR_TOKEN", "operator-token")
    assert load_credentials(SecurityConfig.model_validate({})).operator_token == "operator-token"

    bound = SecurityConfig.model_validate({"replica_tokens": "bound"})
    monkeypatch.delenv("KVRELAY_REPLICA_TOKEN")
    monkeypatch.setenv("KVRELAY_REPLICA_SECRET", "s\udcff")
    with pytest.raises(SecurityError, match="security.replica_secret_env .* not text"):
        load_credentials(bound)
    monkeypatch.setenv("KVRELAY_REPLICA_SECRET", "p\u00e4ssw\u00f6rd")  # any text is an HMAC key
    assert load_credentials(bound).replica_secret == "p\u00e4ssw\u00f6rd"
    (tmp_path / "secret").write_bytes(b"abc\xff\xfe")
    with pytest.raises(SecurityError, match="security.replica_secret_file: .* not UTF-8"):
        load_credentials(
            SecurityConfig.model_validate(
                {"replica_tokens": "bound", "replica_secret_file": str(tmp_path / "secret")}
            )
        )

    # The real broker: exit 2 naming the variable, not SERVING and failing every call.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_") or k == "KVRELAY_LOG_FORMAT"}
    env.update(
        KVRELAY_API_TOKEN="api-token",
        KVRELAY_REPLICA_TOKEN="replica-token",
        KVRELAY_OPERATOR_TOKEN="op\udcff",
    )
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay", "broker", "--config", str(REPO / "tests/configs/test-fast.yaml"),
         "--port", "0", "--metrics-port", "0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert "security.operator_token_env ($KVRELAY_OPERATOR_TOKEN)" in out.stderr
