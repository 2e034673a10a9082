"""The blocking SDK against a real gRPC server: events, results, errors, cancel, deadlines, retries."""

from __future__ import annotations

import dataclasses
import io
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message
from PIL import Image

from kvrelay.client import (
    GenerationEvent,
    GenerationState,
    KvRelayClient,
    KvRelayError,
    PoolStatus,
    Replica,
    ReplicaRole,
    RetryPolicy,
    Ticket,
    TicketOutcome,
    TicketState,
    TransportKind,
)
from kvrelay.v1 import broker_pb2, common_pb2, generation_pb2
from tests.client.harness import Harness, ServerThread

S = GenerationState
PB = generation_pb2.GenerationState
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)


def _no_protobuf(value: object, path: str = "value") -> None:
    """No protobuf message anywhere inside a public value."""
    assert not isinstance(value, Message), f"{path} is a protobuf message"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _no_protobuf(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _no_protobuf(item, f"{path}[{i}]")


@pytest.fixture
def client(server: ServerThread) -> KvRelayClient:
    with KvRelayClient(server.address, retry=FAST_RETRY) as c:
        yield c


def test_generate_streams_every_stage_then_a_png_of_the_requested_size(client: KvRelayClient) -> None:
    handle = client.generate("a red fox", seed=42, width=128, height=96, num_inference_steps=3)
    events = list(handle.events())
    assert [e.state for e in events] == [S.QUEUED, S.PREFILLING, S.TRANSFERRING] + [S.DENOISING] * 3 + [
        S.SUCCEEDED
    ]
    assert [(e.step, e.total_steps) for e in events if e.state == S.DENOISING] == [(1, 3), (2, 3), (3, 3)]
    assert all(isinstance(e, GenerationEvent) and isinstance(e.state, GenerationState) for e in events)
    assert handle.request_id and all(e.request_id == handle.request_id for e in events)
    for event in events:
        _no_protobuf(event)
    result = handle.result()
    _no_protobuf(result)
    assert (result.width, result.height, result.seed) == (128, 96, 42)
    assert Image.open(io.BytesIO(result.png)).size == (128, 96)
    assert result.timings.total_seconds > 0
    assert result.png == events[-1].image.png


def test_result_alone_waits_and_the_generation_can_be_read_back(client: KvRelayClient, tmp_path) -> None:
    result = client.generate("a lighthouse", seed=7, width=64, height=64).result()
    out = tmp_path / "deep" / "out.png"
    result.save(out)
    assert Image.open(out).size == (64, 64)
    generation = client.get_generation(result.request_id)
    _no_protobuf(generation)
    assert generation.state == S.SUCCEEDED
    assert generation.image is not None and generation.image.png == result.png
    assert generation.params is not None and generation.params.seed == 7
    second = client.generate("a second one", width=64, height=64).result()
    listed = client.list_generations()
    assert [g.request_id for g in listed] == [second.request_id, result.request_id]  # newest first
    assert all(g.image is None for g in listed)
    assert client.list_generations([S.FAILED]) == []


def test_invalid_input_is_one_kvrelay_error_naming_the_field(client: KvRelayClient) -> None:
    # Out of the broker's bounds (kvrelay.limits): refused by generate() itself, before sending.
    with pytest.raises(KvRelayError) as info:
        client.generate("ok", width=100)
    err = info.value
    assert not isinstance(err, grpc.RpcError)
    assert (err.code, err.reason, err.details["field"]) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT", "width")
    assert "multiple of 16" in err.message
    with pytest.raises(KvRelayError) as info:
        list(client.generate("").events())
    assert info.value.details["field"] == "prompt"


def test_values_the_wire_cannot_carry_are_refused_before_any_call(
    client: KvRelayClient, harness: Harness
) -> None:
    for kwargs in ({"seed": -1}, {"width": -64}, {"num_inference_steps": 2**33}):
        with pytest.raises(KvRelayError) as info:
            client.generate("x", **kwargs)
        assert info.value.code == "INVALID_ARGUMENT" and info.value.details["field"] == next(iter(kwargs))
    assert harness.calls["Generate"] == 0


def test_unknown_id_is_not_found_with_the_servers_reason(client: KvRelayClient) -> None:
    with pytest.raises(KvRelayError) as info:
        client.get_generation("nope")
    assert (info.value.code, info.value.reason, info.value.request_id) == (
        "NOT_FOUND",
        "GENERATION_NOT_FOUND",
        "nope",
    )


def test_a_failed_generation_is_an_event_and_result_raises_its_code_and_reason(client: KvRelayClient) -> None:
    handle = client.generate("fail:TRANSFER_TIMEOUT", width=64, height=64)
    events = list(handle.events())
    assert events[-1].state == S.FAILED
    assert events[-1].error is not None and events[-1].error.reason == "TRANSFER_TIMEOUT"
    with pytest.raises(KvRelayError) as info:
        handle.result()
    assert (info.value.code, info.value.reason) == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT")
    assert info.value.request_id == handle.request_id


def test_cancel_mid_denoise_cancels_on_the_server_and_ends_the_stream(
    client: KvRelayClient, server: ServerThread, harness: Harness
) -> None:
    harness.step_delay = 0.1
    handle = client.generate("slow", width=64, height=64, num_inference_steps=200)
    seen = []
    for event in handle.events():
        seen.append(event)
        if event.state == S.DENOISING and event.step == 2:
            handle.cancel()
    assert seen[-1].state == S.CANCELLED
    assert harness.calls["CancelGeneration"] == 1
    generation = server.wait_for_state(handle.request_id, PB.GENERATION_STATE_CANCELLED)
    assert harness.generations[handle.request_id].cancelled_by == "CancelGeneration"
    assert generation.step < 200
    with pytest.raises(KvRelayError) as info:
        handle.result()
    assert info.value.code == "CANCELLED"
    handle.cancel()  # idempotent once ended
    assert harness.calls["CancelGeneration"] == 1


def test_cancel_from_another_thread_ends_a_blocked_iteration(client: KvRelayClient, harness: Harness) -> None:
    harness.step_delay = 0.2
    handle = client.generate("slow", width=64, height=64, num_inference_steps=500, request_id="r-thread")
    states: list[GenerationState] = []
    consumer = threading.Thread(target=lambda: states.extend(e.state for e in handle.events()))
    consumer.start()
    while S.DENOISING not in states:
        time.sleep(0.01)
    started = time.monotonic()
    handle.cancel()
    consumer.join(5)
    assert not consumer.is_alive()
    assert time.monotonic() - started < 3
    assert states[-1] == S.CANCELLED
    assert client.get_generation("r-thread").state == S.CANCELLED


def test_result_waits_for_a_thread_that_iterates_the_events(client: KvRelayClient, harness: Harness) -> None:
    harness.step_delay = 0.05
    handle = client.generate("x", width=64, height=64, num_inference_steps=10)
    states: list[GenerationState] = []
    consumer = threading.Thread(target=lambda: states.extend(e.state for e in handle.events()))
    consumer.start()
    while not states:
        time.sleep(0.005)
    with pytest.raises(RuntimeError, match="already being iterated"):
        next(iter(handle.events()))
    result = handle.result()  # waits for the consumer's iteration to see the end
    consumer.join(5)
    assert states[-1] == S.SUCCEEDED and states.count(S.DENOISING) == 10
    assert result.request_id == handle.request_id and handle.done


def _ends_within(target: object, seconds: float = 30.0) -> list[object]:
    """Run `target` in a thread; what it returned or raised (the thread is a daemon: a hang
    fails the test instead of the run)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(target())  # type: ignore[operator]
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the call never returned"
    return out


def test_result_after_an_iteration_left_open_does_not_hang(client: KvRelayClient, harness: Harness) -> None:
    # An events() iterator kept in a variable and not run to its end (here: after its first
    # event) is suspended, not iterating: result() reads the stream itself. Before, found
    # black-box, result() waited forever for that iterator to see the end, past the deadline.
    harness.step_delay = 0.01
    handle = client.generate("x", width=64, height=64, num_inference_steps=5)
    events = handle.events()
    assert next(events).state == S.QUEUED
    (result,) = _ends_within(handle.result)
    assert not isinstance(result, BaseException), result
    assert result.request_id == handle.request_id and handle.done  # type: ignore[attr-defined]
    # The iterator left open still sees every later event (result() kept them for it).
    rest = [e.state for e in events]
    assert rest[-1] == S.SUCCEEDED and rest.count(S.DENOISING) == 5 and rest.count(S.SUCCEEDED) == 1, rest


def test_cancel_then_result_after_an_iteration_left_open_raises_cancelled(
    client: KvRelayClient, harness: Harness
) -> None:
    harness.step_delay = 0.2
    handle = client.generate("slow", width=64, height=64, num_inference_steps=500)
    events = handle.events()
    next(events)
    handle.cancel()
    (error,) = _ends_within(handle.result)
    assert isinstance(error, KvRelayError) and error.code == "CANCELLED", error
    assert [e.state for e in events][-1] == S.CANCELLED


def test_closing_the_client_drops_the_stream_which_cancels_the_generation(
    server: ServerThread, harness: Harness
) -> None:
    harness.step_delay = 0.1
    client = KvRelayClient(server.address)
    handle = client.generate("slow", width=64, height=64, num_inference_steps=200)
    for event in handle.events():
        if event.state == S.DENOISING:
            break
    request_id = handle.request_id
    client.close()
    server.wait_for_state(request_id, PB.GENERATION_STATE_CANCELLED)
    assert harness.generations[request_id].cancelled_by == "stream_dropped"
    assert harness.calls["CancelGeneration"] == 0


def test_context_manager_cancels_an_unfinished_generation(
    client: KvRelayClient, server: ServerThread, harness: Harness
) -> None:
    harness.step_delay = 0.1
    with pytest.raises(RuntimeError, match="boom"):
        with client.generate("slow", width=64, height=64, num_inference_steps=200) as handle:
            next(iter(handle.events()))
            raise RuntimeError("boom")
    server.wait_for_state(handle.request_id, PB.GENERATION_STATE_CANCELLED)


def test_every_call_carries_a_deadline_and_a_generation_deadline_ends_it(
    client: KvRelayClient, harness: Harness
) -> None:
    harness.step_delay = 0.2
    handle = client.generate("slow", width=64, height=64, num_inference_steps=100, timeout=0.8)
    started = time.monotonic()
    with pytest.raises(KvRelayError) as info:
        handle.result()
    assert info.value.code == "DEADLINE_EXCEEDED"
    assert time.monotonic() - started < 3
    assert 0 < harness.deadlines["Generate"][0] <= 0.85
    client.list_generations()
    client.get_generation(handle.request_id, timeout=2.5)
    assert 0 < harness.deadlines["ListGenerations"][0] <= 30.1  # the client's default
    assert 0 < harness.deadlines["GetGeneration"][0] <= 2.55
    default_generate = KvRelayClient(client.target).generate("x", width=64, height=64)
    default_generate.result()
    assert 590 < harness.deadlines["Generate"][1] <= 601.5  # grpc-timeout may round up to whole seconds


def test_reads_are_retried_on_unavailable_within_the_attempt_budget(
    client: KvRelayClient, harness: Harness
) -> None:
    request_id = client.generate("x", width=64, height=64).result().request_id
    harness.unavailable["GetGeneration"] = 2
    assert client.get_generation(request_id).state == S.SUCCEEDED
    assert harness.calls["GetGeneration"] == 3
    harness.unavailable["ListReplicas"] = 10
    with pytest.raises(KvRelayError) as info:
        client.list_replicas()
    assert (info.value.code, info.value.reason) == ("UNAVAILABLE", "REPLICA_DOWN")
    assert harness.calls["ListReplicas"] == FAST_RETRY.max_attempts


def test_generate_without_a_request_id_is_never_repeated(client: KvRelayClient, harness: Harness) -> None:
    harness.unavailable["Generate"] = 1
    with pytest.raises(KvRelayError) as info:
        client.generate("x", width=64, height=64).result()
    assert info.value.code == "UNAVAILABLE"
    assert harness.calls["Generate"] == 1
    harness.break_stream_after, harness.break_streams = 3, 1
    with pytest.raises(KvRelayError) as info:
        client.generate("y", width=64, height=64).result()
    assert (info.value.code, info.value.reason) == ("UNAVAILABLE", "STREAM_BROKEN")
    assert harness.calls["Generate"] == 2


def test_generate_with_a_request_id_reattaches_to_the_same_generation(
    client: KvRelayClient, harness: Harness
) -> None:
    harness.unavailable["Generate"] = 1
    assert client.generate("x", width=64, height=64, request_id="r-1").result().request_id == "r-1"
    assert harness.calls["Generate"] == 2
    harness.break_stream_after, harness.break_streams = 4, 2
    handle = client.generate("y", width=64, height=64, num_inference_steps=4, request_id="r-2")
    states = [e.state for e in handle.events()]
    assert states[-1] == S.SUCCEEDED
    assert harness.calls["Generate"] == 5  # r-1 twice, r-2 once + two re-attaches
    assert sorted(harness.generations) == ["r-1", "r-2"]  # re-attached, never resubmitted


def test_reattach_rides_out_an_outage_within_its_window_then_gives_up(
    server: ServerThread, harness: Harness
) -> None:
    patient = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.05, reattach_seconds=10)
    with KvRelayClient(server.address, retry=patient) as client:
        harness.unavailable["Generate"] = 12  # far more than max_attempts: a restarting broker
        assert client.generate("x", width=64, height=64, request_id="outage").result().request_id == "outage"
        assert harness.calls["Generate"] == 13
    impatient = RetryPolicy(initial_backoff=0.01, max_backoff=0.05, reattach_seconds=0.5)
    with KvRelayClient(server.address, retry=impatient) as client:
        harness.unavailable["Generate"] = 10_000
        started = time.monotonic()
        with pytest.raises(KvRelayError) as info:
            client.generate("x", width=64, height=64, request_id="down").result()
        assert info.value.code == "UNAVAILABLE"
        assert 0.5 <= time.monotonic() - started < 3


def test_a_request_id_asks_the_broker_to_wait_reattach_seconds_and_the_double_does(
    server: ServerThread, harness: Harness
) -> None:
    harness.step_delay = 0.05
    patient = RetryPolicy(initial_backoff=0.01, max_backoff=0.05, reattach_seconds=5.0)
    away = KvRelayClient(server.address, retry=patient)
    handle = away.generate("x", width=64, height=64, num_inference_steps=200, request_id="detached")
    for event in handle.events():
        if event.state == S.DENOISING:
            break
    away.close()  # gone without a cancel: the generation waits 5 s for a re-attach
    with KvRelayClient(server.address, retry=patient) as client:
        again = client.generate("x", width=64, height=64, num_inference_steps=200, request_id="detached")
        assert next(iter(again.events())).state == S.DENOISING  # re-attached in time: still running
        again.cancel()
        assert harness.generations["detached"].cancelled_by == "CancelGeneration"
    brief = RetryPolicy(initial_backoff=0.01, max_backoff=0.05, reattach_seconds=0.6)
    with KvRelayClient(server.address, retry=brief) as client:
        handle = client.generate("y", width=64, height=64, num_inference_steps=200, request_id="left")
        for event in handle.events():
            if event.state == S.DENOISING:
                break
        handle._call.cancel()  # the stream ends without CancelGeneration (what a crash looks like)
        dropped = time.monotonic()
        server.wait_for_state("left", PB.GENERATION_STATE_CANCELLED)
        assert time.monotonic() - dropped >= 0.6
        assert harness.generations["left"].cancelled_by == "detach_expired"
    sent = {r.request_id: r.detach_timeout_seconds for r in harness.generate_requests}
    assert sent == {"detached": 5.0, "left": 0.6}
    with KvRelayClient(server.address) as client:
        client.generate("z", width=64, height=64).result()
    assert harness.generate_requests[-1].detach_timeout_seconds == 0.0  # no id: nothing to wait for


def test_same_request_id_with_other_parameters_is_already_exists(client: KvRelayClient) -> None:
    client.generate("x", width=64, height=64, request_id="dup").result()
    again = client.generate("x", width=64, height=64, request_id="dup").result()
    assert again.request_id == "dup"
    with pytest.raises(KvRelayError) as info:
        client.generate("other prompt", width=64, height=64, request_id="dup").result()
    assert (info.value.code, info.value.reason) == ("ALREADY_EXISTS", "REQUEST_ID_REUSED")


def test_bearer_token_is_sent(server: ServerThread, harness: Harness) -> None:
    harness.token = "s3cret"
    with KvRelayClient(server.address) as anonymous:
        with pytest.raises(KvRelayError) as info:
            anonymous.list_generations()
    assert info.value.code == "UNAUTHENTICATED"
    with KvRelayClient(server.address, token="s3cret") as authed:
        assert authed.generate("x", width=64, height=64).result().width == 64


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_with_the_servers_root_certificate(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    server = ServerThread(Harness(), credentials).start()
    try:
        with KvRelayClient(f"localhost:{server.port}", root_certificates=cert.read_bytes()) as client:
            assert client.generate("x", width=64, height=64).result().width == 64
        with KvRelayClient(f"localhost:{server.port}", retry=FAST_RETRY) as plaintext:
            with pytest.raises(KvRelayError) as info:
                plaintext.list_generations(timeout=5)
            assert info.value.code == "UNAVAILABLE"
        with KvRelayClient(f"localhost:{server.port}", tls=True, retry=FAST_RETRY) as untrusted:
            with pytest.raises(KvRelayError) as info:
                untrusted.list_generations(timeout=5)
            assert info.value.code == "UNAVAILABLE"  # the self-signed certificate is not in the system roots
    finally:
        server.stop()


def test_an_unreachable_broker_is_unavailable_not_a_raw_grpc_error() -> None:
    from tests.client.harness import Harness as _H  # noqa: F401 - same import path as the fixtures

    with KvRelayClient("127.0.0.1:1", retry=FAST_RETRY) as client:
        started = time.monotonic()
        with pytest.raises(KvRelayError) as info:
            client.get_generation("x", timeout=5)
        assert info.value.code == "UNAVAILABLE" and not isinstance(info.value, grpc.RpcError)
        assert time.monotonic() - started < 5
        with pytest.raises(KvRelayError) as info:
            client.generate("x").result()
        assert info.value.code == "UNAVAILABLE"
        # With a request_id too: nothing ever answered, so no waiting out the re-attach window.
        started = time.monotonic()
        with pytest.raises(KvRelayError) as info:
            client.generate("x", request_id="nobody-home").result()
        assert info.value.code == "UNAVAILABLE"
        assert time.monotonic() - started < 3


def test_a_2048_square_png_fits_in_one_message(client: KvRelayClient) -> None:
    result = client.generate("noise", width=2048, height=2048, num_inference_steps=1).result()
    assert len(result.png) > 8 * 1024 * 1024  # well past gRPC's 4 MiB default
    assert Image.open(io.BytesIO(result.png)).size == (2048, 2048)


def test_status_reads_decode_into_dataclasses(client: KvRelayClient, harness: Harness) -> None:
    harness.replicas = [
        broker_pb2.ReplicaInfo(
            replica_id="dit-0",
            role=common_pb2.REPLICA_ROLE_DIT,
            incarnation_id="inc-1",
            endpoint="127.0.0.1:50071",
            geometry=common_pb2.KvGeometry(
                num_layers=2, num_kv_heads=4, head_dim=32, dtype=common_pb2.DTYPE_BFLOAT16, page_size=16
            ),
            parallelism=common_pb2.Parallelism(tensor_parallel_size=2, sequence_parallel_size=1),
            num_pages=100,
            transport=common_pb2.TRANSPORT_KIND_MOONCAKE,
            stage_id=1,
            up=True,
            max_image_side=1024,
        )
    ]
    harness.pools = [
        broker_pb2.PoolStatus(
            replica_id="dit-0", total_pages=100, free_pages=90, reserved_pages=6, draining_pages=4, up=True,
            available_pages=90,
        )
    ]
    harness.tickets = [
        broker_pb2.Ticket(
            ticket_id="t1",
            request_id="r1",
            state=broker_pb2.TICKET_STATE_DRAINING,
            outcome=broker_pb2.TICKET_OUTCOME_CANCELLED,
            rows=[common_pb2.RowPages(row=0, num_tokens=20, page_ids=[3, 4])],
            dit_replica_id="dit-0",
            armed=True,
        ),
        broker_pb2.Ticket(ticket_id="t2", state=broker_pb2.TICKET_STATE_RELEASED),
    ]
    [replica] = client.list_replicas()
    assert isinstance(replica, Replica)
    assert (replica.role, replica.transport, replica.tensor_parallel_size) == (
        ReplicaRole.DIT,
        TransportKind.MOONCAKE,
        2,
    )
    assert replica.geometry is not None and replica.geometry.dtype == "bfloat16"
    assert replica.max_image_side == 1024
    assert client.get_pools() == [PoolStatus("dit-0", 100, 90, 6, 4, False, up=True, available_pages=90)]
    with pytest.raises(KvRelayError) as info:
        client.get_pools("dit-9")
    assert info.value.code == "NOT_FOUND"
    [ticket] = client.list_tickets()
    assert isinstance(ticket, Ticket)
    assert (ticket.state, ticket.outcome, ticket.num_pages, ticket.rows[0].page_ids) == (
        TicketState.DRAINING,
        TicketOutcome.CANCELLED,
        2,
        (3, 4),
    )
    assert [t.ticket_id for t in client.list_tickets([TicketState.RELEASED])] == ["t2"]
    for value in (replica, ticket, *client.get_pools()):
        _no_protobuf(value)


def test_kvrelay_error_pickles_and_prints_code_and_reason() -> None:
    import pickle

    err = KvRelayError(
        "NOT_FOUND", "GENERATION_NOT_FOUND", "unknown generation 'x'", {"id": "x"}, request_id="x"
    )
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.code, copy.reason, copy.message, dict(copy.details), copy.request_id) == (
        "NOT_FOUND",
        "GENERATION_NOT_FOUND",
        "unknown generation 'x'",
        {"id": "x"},
        "x",
    )
    assert str(err) == "NOT_FOUND GENERATION_NOT_FOUND: unknown generation 'x'"


def test_importing_the_client_loads_no_torch_config_or_service() -> None:
    code = (
        "import sys, kvrelay.client; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('kvrelay.config', "
        "'kvrelay.broker', 'kvrelay.ar_service', 'kvrelay.dit_service', 'kvrelay.models', 'kvrelay.transfer'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_closed_client_raises_kvrelay_error_not_grpcs_value_error(
    server: ServerThread, harness: Harness
) -> None:
    harness.step_delay = 0.1
    client = KvRelayClient(server.address)
    handle = client.generate("slow", width=64, height=64, num_inference_steps=200)
    next(iter(handle.events()))
    client.close()
    # The open stream, and every call after close(): one KvRelayError (grpc raised ValueError).
    for action in (
        handle.result,
        lambda: client.generate("x"),
        lambda: client.get_generation("missing"),
        client.list_generations,
    ):
        with pytest.raises(KvRelayError) as info:
            action()
        assert (info.value.code, info.value.reason) == ("CANCELLED", "CLIENT_CLOSED")
    client.close()  # idempotent


def test_events_of_an_ended_generation_repeat_only_its_terminal_event(client: KvRelayClient) -> None:
    handle = client.generate("a fox", width=64, height=64, num_inference_steps=2)
    first = list(handle.events())
    assert first[-1].state == S.SUCCEEDED
    # A second pass used to raise UNAVAILABLE/STREAM_ENDED ("ended before the generation finished").
    assert list(handle.events()) == [first[-1]]
    assert handle.result().request_id == first[-1].request_id


@pytest.mark.parametrize("page_size", [-1, 1 << 32])
def test_a_page_size_the_wire_cannot_carry_is_invalid_argument(client: KvRelayClient, page_size: int) -> None:
    # protobuf's ValueError reached the caller (and `kvrelay list --limit -1` printed a traceback).
    with pytest.raises(KvRelayError) as info:
        client.list_generations(page_size=page_size)
    assert info.value.code == "INVALID_ARGUMENT" and info.value.details == {"field": "page_size"}
