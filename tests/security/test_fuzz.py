"""Hostile callers against every RPC of every service (hypothesis, the CI profile).

Messages are built from the request descriptors (ids naming other replicas, empty and oversized
strings, boundary integers, NaN and infinities, unknown enum values, nested and repeated fields)
or are undecodable bytes. They go to the real servers of tests/security/harness.py as an
anonymous caller, as a wrong replica (the replica token, its own id `ar-1`) and, for the public
API, as a client with the api token. No answer may be UNKNOWN or INTERNAL, the servers stay up,
and the victims' registrations, pools and tickets are exactly as before: pools full afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2
from hypothesis import given
from hypothesis import strategies as st

from kvrelay.security import CallerClass, ChannelSecurity
from kvrelay.v1 import ar_pb2, broker_pb2, dit_pb2, generation_pb2
from tests.security.harness import API, CREDENTIALS, WRONG_REPLICA, SecuredDeployment, secured_deployment

pytestmark = pytest.mark.slow

# (server, service descriptor)
SERVICES = [
    ("broker", broker_pb2.DESCRIPTOR.services_by_name["BrokerService"]),
    ("broker", generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]),
    ("ar", ar_pb2.DESCRIPTOR.services_by_name["ArService"]),
    ("dit", dit_pb2.DESCRIPTOR.services_by_name["DitService"]),
    ("broker", health_pb2.DESCRIPTOR.services_by_name["Health"]),
]
METHODS = [(server, f"/{svc.full_name}/{m.name}", m) for server, svc in SERVICES for m in svc.methods]
NEVER = {"UNKNOWN", "INTERNAL", "DATA_LOSS"}
CALLERS = {
    "anonymous": None,
    "wrong_replica": CREDENTIALS.channel(CallerClass.REPLICA, WRONG_REPLICA),
    "api_client": ChannelSecurity(token=API),
}

IDS = st.sampled_from(["", "ar-0", "dit-0", "ar-1", "broker", "ar-0-inc-1", "dit-0-inc-1", "x" * 300, "../../etc"])
TEXT = st.one_of(IDS, st.text(max_size=40))
INTS = {
    _descriptor.FieldDescriptor.TYPE_UINT32: st.sampled_from([0, 1, 2, 7, 64, 2**16, 2**31 - 1, 2**32 - 1]),
    _descriptor.FieldDescriptor.TYPE_UINT64: st.sampled_from([0, 1, 4096, 2**32, 2**63, 2**64 - 1]),
    _descriptor.FieldDescriptor.TYPE_INT32: st.sampled_from([0, -1, 1, 2**31 - 1, -(2**31)]),
    _descriptor.FieldDescriptor.TYPE_INT64: st.sampled_from([0, -1, 1, 2**63 - 1, -(2**63)]),
}
FLOATS = st.sampled_from([0.0, -1.0, 1.0, 2.0, 1e308, -1e308, math.inf, -math.inf, math.nan, 1e-300])


def _value(field: _descriptor.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    t = field.type
    if t == field.TYPE_STRING:
        return TEXT
    if t == field.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == field.TYPE_BOOL:
        return st.booleans()
    if t in INTS:
        return INTS[t]
    if t in (field.TYPE_DOUBLE, field.TYPE_FLOAT):
        return FLOATS
    if t == field.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [99, -5])
    if t == field.TYPE_MESSAGE:
        return message_of(field.message_type, depth + 1)
    return st.none()


def message_of(desc: _descriptor.Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    cls = message_factory.GetMessageClass(desc)
    if depth > 2:
        return st.just(cls())
    fields = {}
    for f in desc.fields:
        value = _value(f, depth)
        if f.label == f.LABEL_REPEATED:
            fields[f.name] = st.lists(value, max_size=3)
        else:
            fields[f.name] = st.one_of(st.none(), value)

    def build(values: dict[str, Any]) -> Any:
        msg = cls()
        for name, value in values.items():
            if value is None:
                continue
            f = desc.fields_by_name[name]
            try:
                if f.label == f.LABEL_REPEATED:
                    if f.type == f.TYPE_MESSAGE:
                        getattr(msg, name).extend(value)
                    else:
                        getattr(msg, name).extend(value)
                elif f.type == f.TYPE_MESSAGE:
                    getattr(msg, name).CopyFrom(value)
                else:
                    setattr(msg, name, value)
            except (ValueError, TypeError):
                pass  # e.g. an enum value the runtime refuses: leave the field unset
        return msg

    return st.fixed_dictionaries(fields).map(build)


def payloads(method: _descriptor.MethodDescriptor) -> st.SearchStrategy[bytes]:
    hostile = message_of(method.input_type).map(lambda m: m.SerializeToString())
    garbage = st.sampled_from([b"\xff\xff\xff\xff", b"\x0a\xff\x01", b"\x08" * 9])
    return st.one_of(hostile, hostile, hostile, garbage)


def ident(data: bytes) -> bytes:
    """Raw bytes both ways: garbage must reach the server as it is."""
    return data


def call(deployment: SecuredDeployment, server: str, path: str, method: _descriptor.MethodDescriptor,
         security: ChannelSecurity | None, payloads: list[bytes]) -> str:  # fmt: skip
    """The status code name of one call (`OK` when it answered)."""
    with deployment.channel(server, security) as channel:
        try:
            if method.client_streaming and method.server_streaming:
                responses = channel.stream_stream(path, ident, ident)(iter(payloads), timeout=5)
                next(iter(responses), None)
                responses.cancel()
            elif method.client_streaming:
                channel.stream_unary(path, ident, ident)(iter(payloads), timeout=5)
            elif method.server_streaming:
                responses = channel.unary_stream(path, ident, ident)(payloads[0], timeout=5)
                next(iter(responses), None)
                responses.cancel()
            else:
                channel.unary_unary(path, ident, ident)(payloads[0], timeout=5)
        except grpc.RpcError as err:
            code = err.code()  # type: ignore[attr-defined]
            if code == grpc.StatusCode.CANCELLED and method.server_streaming:
                return "OK"  # we cancelled it after the first answer
            return str(code.name)
    return "OK"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredDeployment]:
    with secured_deployment(tmp_path_factory.mktemp("fuzz")) as d:
        d.initial = d.snapshot()  # type: ignore[attr-defined]
        yield d
        # After everything (every test of this module): no crash, no change, pools full.
        assert d.snapshot() == d.initial  # type: ignore[attr-defined]


def _expected(caller: str, path: str) -> set[str] | None:
    """What the interceptor must answer before any servicer runs (None: the servicer answers)."""
    if path.startswith("/grpc.health"):
        return None
    public = path.startswith("/kvrelay.v1.GenerationService/")
    if caller == "anonymous":
        return {"UNAUTHENTICATED", "INVALID_ARGUMENT"}  # INVALID_ARGUMENT: undecodable, refused first
    if caller == "wrong_replica" and public:
        return {"PERMISSION_DENIED", "INVALID_ARGUMENT"}
    if caller == "api_client" and not public:
        return {"PERMISSION_DENIED", "INVALID_ARGUMENT"}
    return None


def test_every_rpc_of_every_service_answers_empty_and_garbage(deployment: SecuredDeployment) -> None:
    for caller, security in CALLERS.items():
        for server, path, method in METHODS:
            for payload in (b"", b"\xff\xff\xff\xff"):
                code = call(deployment, server, path, method, security, [payload])
                assert code not in NEVER, (caller, path, payload, code)
                expected = _expected(caller, path)
                assert expected is None or code in expected, (caller, path, payload, code)
    assert deployment.snapshot() == deployment.initial  # type: ignore[attr-defined]


@given(data=st.data())
def test_hostile_messages_as_anonymous_wrong_replica_and_client(deployment: SecuredDeployment, data: st.DataObject) -> None:
    caller = data.draw(st.sampled_from(sorted(CALLERS)), label="caller")
    server, path, method = data.draw(st.sampled_from(METHODS), label="method")
    count = data.draw(st.integers(1, 3)) if method.client_streaming else 1
    messages = [data.draw(payloads(method), label="payload") for _ in range(count)]
    code = call(deployment, server, path, method, CALLERS[caller], messages)
    assert code not in NEVER, (caller, path, code)
    expected = _expected(caller, path)
    assert expected is None or code in expected, (caller, path, code)
    assert deployment.snapshot() == deployment.initial  # type: ignore[attr-defined]
