"""GenerationService over real gRPC: validation, defaults, idempotency, Get/List/Cancel, retention."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import grpc
import pytest

from kvrelay.errors import KvRelayServerError
from kvrelay.v1 import generation_pb2, generation_pb2_grpc

from .harness import cluster, collect, error_info, png_size, request, run, wait_until

S = generation_pb2


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "   "}, "prompt"),
        ({"width": 63}, "width"),
        ({"width": 72}, "width"),
        ({"width": 48}, "width"),
        ({"width": 2064}, "width"),
        ({"height": 0}, "height"),
        ({"height": 100}, "height"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"num_inference_steps": 1001}, "num_inference_steps"),
        ({"guidance_scale": 0.99}, "guidance_scale"),
        ({"guidance_scale": math.nan}, "guidance_scale"),
        ({"guidance_scale": math.inf}, "guidance_scale"),
        ({"request_id": "has space"}, "request_id"),
        ({"request_id": "x" * 129}, "request_id"),
    ],
)
def test_invalid_input_is_rejected_naming_the_field(fields: dict[str, object], field: str) -> None:
    async def body() -> None:
        async with cluster() as c:
            prompt = fields.pop("prompt", "a cat")
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(c.api.Generate(request(str(prompt), **fields), timeout=5))
            code, reason, metadata = error_info(exc.value)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert reason == "INVALID_ARGUMENT"
            assert metadata["field"] == field
            assert exc.value.details().startswith(f"{field}:")
            # Nothing was accepted: no generation, no ticket, no prefill.
            assert c.orchestrator.list_generations() == []
            assert c.core.list_tickets() == []
            assert c.ar.prefills == []

    run(body())


def test_bounds_are_inclusive() -> None:
    async def body() -> None:
        async with cluster() as c:
            events = await collect(
                c.api.Generate(
                    request(width=64, height=2048, num_inference_steps=1, guidance_scale=1.0, seed=3),
                    timeout=10,
                )
            )
            final = events[-1]
            assert final.state == S.GENERATION_STATE_SUCCEEDED, final.error
            assert png_size(final.image.png) == (64, 2048)
            # guidance 1.0 = no CFG: one row, so one row's pages were reserved.
            (ticket,) = c.core.list_tickets([c.core.get_ticket(final.ticket_id).state])
            assert len(ticket.rows) == 1

    run(body())


def test_defaults_are_the_seed_workload_and_a_seed_is_assigned() -> None:
    async def body() -> None:
        async with cluster() as c:
            events = await collect(c.api.Generate(S.GenerateRequest(prompt="a red fox"), timeout=10))
            final = events[-1]
            assert final.state == S.GENERATION_STATE_SUCCEEDED, final.error
            assert (final.image.width, final.image.height) == (512, 512)
            assert png_size(final.image.png) == (512, 512)
            got = (
                await c.api.GetGeneration(S.GetGenerationRequest(request_id=final.request_id), timeout=5)
            ).generation
            assert (got.params.width, got.params.height, got.params.num_inference_steps) == (512, 512, 2)
            assert got.params.guidance_scale == 2.0
            assert got.params.seed == final.image.seed
            assert final.total_steps == 2
            # guidance 2.0: the negative (here unconditional) row was reserved too.
            assert len(c.core.get_ticket(final.ticket_id).rows) == 2
            # Each request without a seed gets its own.
            again = await collect(c.api.Generate(S.GenerateRequest(prompt="a red fox"), timeout=10))
            assert again[-1].image.seed != final.image.seed

    run(body())


def test_same_request_id_and_params_attach_to_one_generation() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.dit.step_gate.clear()
            first = c.api.Generate(request(request_id="req-1", seed=5), timeout=10)
            assert (await first.read()).state == S.GENERATION_STATE_QUEUED
            await c.dit.loaded.wait()
            # A retry with the same seed attaches, and so does one that leaves the seed out
            # (it asks for "any seed", which the existing generation satisfies).
            second = c.api.Generate(request(request_id="req-1", seed=5), timeout=10)
            third = c.api.Generate(request(request_id="req-1"), timeout=10)
            c.dit.step_gate.set()
            a, b, d = await asyncio.gather(collect(first), collect(second), collect(third))
            for events in (a, b, d):
                assert events[-1].state == S.GENERATION_STATE_SUCCEEDED
                assert events[-1].image.png == a[-1].image.png
            assert c.ar.prefills == ["req-1"]
            # Finished and retained: attaching again returns the result at once.
            replay = await collect(c.api.Generate(request(request_id="req-1", seed=5), timeout=5))
            assert [e.state for e in replay] == [S.GENERATION_STATE_SUCCEEDED]
            assert c.ar.prefills == ["req-1"]

    run(body())


def test_streams_attached_to_one_generation_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found black-box: attaching needs only the request_id and parameters, and each Generate
    # stream held ~25 KB of the broker; one client could attach to its own generation without bound.
    import kvrelay.broker.generation as generation

    monkeypatch.setattr(generation, "MAX_STREAMS_PER_GENERATION", 3)

    async def body() -> None:
        async with cluster() as c:
            c.dit.step_gate.clear()
            streams = [c.api.Generate(request(request_id="req-1", seed=5), timeout=10) for _ in range(3)]
            for stream in streams:
                assert (await stream.read()).state == S.GENERATION_STATE_QUEUED
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(c.api.Generate(request(request_id="req-1", seed=5), timeout=10))
            code, reason, _ = error_info(exc.value)
            assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_STREAMS")
            # A stream that leaves frees its place; the generation goes on for the others.
            streams[0].cancel()
            await wait_until(lambda: len(c.orchestrator.store.get("req-1").subscribers) == 2)
            streams.append(c.api.Generate(request(request_id="req-1", seed=5), timeout=10))
            c.dit.step_gate.set()
            for events in await asyncio.gather(*(collect(s) for s in streams[1:])):
                assert events[-1].state == S.GENERATION_STATE_SUCCEEDED
            assert c.ar.prefills == ["req-1"]

    run(body())


def test_same_request_id_other_params_is_already_exists() -> None:
    async def body() -> None:
        async with cluster() as c:
            await collect(c.api.Generate(request(request_id="req-2", seed=5), timeout=10))
            for other in (
                request(request_id="req-2", seed=6),
                request("a dog", request_id="req-2", seed=5),
                request(request_id="req-2", seed=5, num_inference_steps=3),
                request(request_id="req-2", seed=5, negative_prompt="blurry"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await collect(c.api.Generate(other, timeout=5))
                code, reason, _ = error_info(exc.value)
                assert (code, reason) == (grpc.StatusCode.ALREADY_EXISTS, "REQUEST_ID_REUSED")
            assert c.ar.prefills == ["req-2"]

    run(body())


def test_get_generation_within_ttl_then_not_found() -> None:
    async def body() -> None:
        async with cluster(result_ttl_seconds=30) as c:
            events = await collect(c.api.Generate(request(request_id="keep", seed=1), timeout=10))
            assert events[-1].state == S.GENERATION_STATE_SUCCEEDED
            c.clock_offset[0] += 29.0
            got = (await c.api.GetGeneration(S.GetGenerationRequest(request_id="keep"), timeout=5)).generation
            assert got.state == S.GENERATION_STATE_SUCCEEDED
            assert got.image.png == events[-1].image.png
            assert got.timings.total_seconds > 0
            c.clock_offset[0] += 2.0
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await c.api.GetGeneration(S.GetGenerationRequest(request_id="keep"), timeout=5)
            assert error_info(exc.value)[:2] == (grpc.StatusCode.NOT_FOUND, "GENERATION_NOT_FOUND")
            # Forgotten: the id may be used again, with any parameters.
            again = await collect(c.api.Generate(request("other", request_id="keep", seed=2), timeout=10))
            assert again[-1].state == S.GENERATION_STATE_SUCCEEDED

    run(body())


def test_finished_generations_are_bounded_by_max_results() -> None:
    async def body() -> None:
        async with cluster(max_results=2) as c:
            for i in range(3):
                await collect(c.api.Generate(request(request_id=f"g{i}", seed=i), timeout=10))
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await c.api.GetGeneration(S.GetGenerationRequest(request_id="g0"), timeout=5)
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND
            for rid in ("g1", "g2"):
                await c.api.GetGeneration(S.GetGenerationRequest(request_id=rid), timeout=5)

    run(body())


def test_list_generations_newest_first_filtered_without_images() -> None:
    async def body() -> None:
        async with cluster() as c:
            for i in range(3):
                await collect(c.api.Generate(request(request_id=f"l{i}", seed=i), timeout=10))
            c.ar.prefill_gate.clear()
            live = c.api.Generate(request(request_id="l3", seed=3), timeout=10)
            await wait_until(lambda: "l3" in c.ar.prefills, what="l3 prefilling")
            listed = (await c.api.ListGenerations(S.ListGenerationsRequest(), timeout=5)).generations
            assert [g.request_id for g in listed] == ["l3", "l2", "l1", "l0"]
            assert all(not g.image.png for g in listed)
            done = await c.api.ListGenerations(
                S.ListGenerationsRequest(states=[S.GENERATION_STATE_SUCCEEDED], page_size=2), timeout=5
            )
            assert [g.request_id for g in done.generations] == ["l2", "l1"]
            running = await c.api.ListGenerations(
                S.ListGenerationsRequest(states=[S.GENERATION_STATE_PREFILLING]), timeout=5
            )
            assert [g.request_id for g in running.generations] == ["l3"]
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await c.api.ListGenerations(
                    S.ListGenerationsRequest(states=[S.GENERATION_STATE_UNSPECIFIED]), timeout=5
                )
            assert error_info(exc.value)[2]["field"] == "states"
            c.ar.prefill_gate.set()
            assert (await collect(live))[-1].state == S.GENERATION_STATE_SUCCEEDED

    run(body())


def test_list_generations_names_ids_and_prompts_only_to_an_operator() -> None:
    """A request_id is the capability of Get/CancelGeneration: a public caller (the api token)
    lists every generation's state, sizes and timings, but not its request_id, ticket_id or
    prompts (found black-box: list, then GetGeneration of another client's id gave its image)."""
    from broker.generation import GenerationServicer
    from kvrelay.security import Caller, CallerClass, _current_caller

    async def listing(servicer: GenerationServicer, caller: Caller) -> list[generation_pb2.Generation]:
        token = _current_caller.set(caller)
        try:
            reply = await servicer.ListGenerations(S.ListGenerationsRequest(), None)  # type: ignore[arg-type]
        finally:
            _current_caller.reset(token)
        return list(reply.generations)

    async def body() -> None:
        async with cluster() as c:
            await collect(c.api.Generate(request(request_id="mine", prompt="a secret fox", seed=1), timeout=10))
            servicer = GenerationServicer(c.orchestrator)
            public = await listing(servicer, Caller(frozenset({CallerClass.PUBLIC}), authenticated=True))
            assert len(public) == 1 and public[0].state == S.GENERATION_STATE_SUCCEEDED
            assert public[0].params.width > 0 and public[0].HasField("timings")
            assert (public[0].request_id, public[0].ticket_id) == ("", "")
            assert (public[0].params.prompt, public[0].params.negative_prompt) == ("", "")
            for caller in (
                Caller(frozenset({CallerClass.OPERATOR}), authenticated=True),
                Caller(frozenset(CallerClass), trusted=True),  # a development deployment
            ):
                full = await listing(servicer, caller)
                assert (full[0].request_id, full[0].params.prompt) == ("mine", "a secret fox")
                assert full[0].ticket_id

    run(body())


def test_list_generations_fits_a_stock_clients_receive_limit() -> None:
    """Retained prompts may be 1 MiB each (prompt and negative prompt): a default page of them
    once failed every ListGenerations with RESOURCE_EXHAUSTED ("Sent message larger than max").
    The reply stops before MAX_LIST_REPLY_BYTES (gRPC's default receive limit), newest first."""
    from kvrelay.broker.generation import MAX_LIST_REPLY_BYTES

    big = "n" * (1 << 20)

    async def body() -> None:
        async with cluster() as c:
            for i in range(6):  # guidance 1.0: the negative prompt is kept, never tokenized
                events = await collect(
                    c.api.Generate(request(request_id=f"b{i}", guidance_scale=1.0, negative_prompt=big), timeout=10)
                )
                assert events[-1].state == S.GENERATION_STATE_SUCCEEDED
            async with grpc.aio.insecure_channel(c.target) as stock:  # default options: 4 MiB replies
                reply = await generation_pb2_grpc.GenerationServiceStub(stock).ListGenerations(
                    S.ListGenerationsRequest(), timeout=5
                )
            assert reply.ByteSize() <= MAX_LIST_REPLY_BYTES
            assert [g.request_id for g in reply.generations] == ["b5", "b4", "b3"]
            assert all(g.params.negative_prompt == big for g in reply.generations)
            one = await c.api.ListGenerations(S.ListGenerationsRequest(page_size=1), timeout=5)
            assert [g.request_id for g in one.generations] == ["b5"]

    run(body())


def test_an_ar_that_does_not_answer_tokenize_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped AR (SIGSTOP, still within its lease) once made Generate fail DEADLINE_EXCEEDED
    after the broker's own Tokenize bound, long before the client's deadline: a code that tells
    the client its deadline passed (and that the SDK does not retry). It is UNAVAILABLE /
    AR_UNAVAILABLE, nothing is accepted, and the id is free for a retry."""
    from kvrelay.broker import admission

    monkeypatch.setattr(admission, "TOKENIZE_TIMEOUT_SECONDS", 0.3)

    async def body() -> None:
        async with cluster() as c:
            c.ar.tokenize_gate.clear()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(c.api.Generate(request(request_id="tk", seed=1), timeout=20))
            code, reason, _ = error_info(exc.value)
            assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "AR_UNAVAILABLE")
            assert "Tokenize on AR replica" in (exc.value.details() or "")
            assert c.orchestrator.list_generations() == [] and c.ar.prefills == []
            c.ar.tokenize_gate.set()
            events = await collect(c.api.Generate(request(request_id="tk", seed=1), timeout=20))
            assert events[-1].state == S.GENERATION_STATE_SUCCEEDED

    run(body())


def test_a_generation_cancelled_while_its_ar_tokenizes_ends_cancelled_at_once_and_stays() -> None:
    """Found black-box (the AR SIGSTOPped, `grpcurl ... Generate`, then `CancelGeneration`):
    CancelGeneration answered CANCELLED, but the Generate stream kept waiting for the AR's Tokenize
    (up to its 10 s bound), then failed UNAVAILABLE AR_UNAVAILABLE, and the generation vanished
    (GetGeneration NOT_FOUND) though its CANCELLED end was counted and journaled. Now the stream
    ends with the CANCELLED event as soon as the cancel comes, and the generation stays CANCELLED."""

    async def body() -> None:
        async with cluster() as c:
            c.ar.tokenize_gate.clear()  # the AR does not answer Tokenize (SIGSTOPped)
            call = c.api.Generate(request(request_id="cx", seed=1, detach_timeout_seconds=60), timeout=30)
            events_task = asyncio.ensure_future(collect(call))
            await wait_until(lambda: c.orchestrator.store.find("cx") is not None, what="the admission")
            cancelled = await c.api.CancelGeneration(S.CancelGenerationRequest(request_id="cx"), timeout=5)
            assert cancelled.generation.state == S.GENERATION_STATE_CANCELLED
            events = await asyncio.wait_for(events_task, 5)  # not Tokenize's bound, nor the AR's answer
            assert events[-1].state == S.GENERATION_STATE_CANCELLED, events
            assert events[-1].error.reason == "CANCELLED_BY_CLIENT"
            c.ar.tokenize_gate.set()  # the AR answers after all: nothing changes
            await asyncio.sleep(0.2)
            got = await c.api.GetGeneration(S.GetGenerationRequest(request_id="cx"), timeout=5)
            assert got.generation.state == S.GENERATION_STATE_CANCELLED
            assert c.ar.prefills == []

    run(body())


def test_an_image_larger_than_the_dit_model_takes_is_invalid_argument() -> None:
    """The API allows sides up to 2048, but BAGEL's (and the demo's) latent position table covers
    1024 pixels: a 2048x2048 request once passed admission and failed INTERNAL (DENOISE_FAILED) in
    the DiT. The DiT registers its model's largest side and admission refuses a larger image,
    naming the side, before anything is accepted."""
    import uuid

    async def body() -> None:
        async with cluster() as c:
            c.dit.max_image_side = 1024
            c.dit.incarnation_id = uuid.uuid4().hex  # a DiT process (re)starting with that model
            await c.dit.register()
            for fields, field in (({"width": 2048, "height": 512}, "width"), ({"height": 1040}, "height")):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await collect(c.api.Generate(request(**fields), timeout=10))
                code, reason, metadata = error_info(exc.value)
                assert (code, reason, metadata["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "IMAGE_TOO_LARGE", field)
                assert "at most 1024 pixels per side" in (exc.value.details() or "")
            assert c.orchestrator.list_generations() == [] and c.ar.prefills == []
            events = await collect(c.api.Generate(request(width=1024, height=1024), timeout=10))
            assert events[-1].state == S.GENERATION_STATE_SUCCEEDED
            (status,) = [s for s in c.core.list_replicas() if s.spec.replica_id == "dit-0"]
            assert status.spec.max_image_side == 1024

    run(body())


def test_cancel_unknown_and_finished() -> None:
    async def body() -> None:
        async with cluster() as c:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await c.api.CancelGeneration(S.CancelGenerationRequest(request_id="nope"), timeout=5)
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND
            await collect(c.api.Generate(request(request_id="done", seed=1), timeout=10))
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await c.api.CancelGeneration(S.CancelGenerationRequest(request_id="done"), timeout=5)
            assert error_info(exc.value)[:2] == (grpc.StatusCode.FAILED_PRECONDITION, "ALREADY_FINISHED")
            got = (await c.api.GetGeneration(S.GetGenerationRequest(request_id="done"), timeout=5)).generation
            assert got.state == S.GENERATION_STATE_SUCCEEDED

    run(body())


def test_metrics_count_outcomes_and_phases() -> None:
    async def body() -> None:
        async with cluster() as c:
            await collect(c.api.Generate(request(seed=1), timeout=10))
            c.ar.prefill_gate.clear()
            call = c.api.Generate(request(request_id="to-cancel", seed=2), timeout=10)
            await wait_until(lambda: "to-cancel" in c.ar.prefills, what="prefilling")
            await c.api.CancelGeneration(S.CancelGenerationRequest(request_id="to-cancel"), timeout=5)
            await collect(call)
            assert c.metric("kvrelay_generations_total", {"outcome": "succeeded"}) == 1
            assert c.metric("kvrelay_generations_total", {"outcome": "cancelled"}) == 1
            assert c.metric("kvrelay_generations_total", {"outcome": "failed"}) == 0
            assert c.metric("kvrelay_generation_seconds_count") == 1
            for phase in ("queue", "prefill", "transfer", "load", "denoise", "decode", "handoff", "total"):
                assert c.metric("kvrelay_phase_seconds_count", {"phase": phase}) == 1, phase

    run(body())


def test_duplicate_during_admission_waits_and_attaches() -> None:
    async def body() -> None:
        async with cluster() as c:
            c.ar.tokenize_gate.clear()
            first = c.api.Generate(request(request_id="dup", seed=1), timeout=10)
            await wait_until(lambda: c.orchestrator.store.find("dup") is not None, what="admission")
            second = c.api.Generate(request(request_id="dup", seed=1), timeout=10)
            other = c.api.Generate(request("other", request_id="dup", seed=1), timeout=10)
            await asyncio.sleep(0.1)
            c.ar.tokenize_gate.set()
            a, b = await asyncio.gather(collect(first), collect(second))
            assert a[-1].state == b[-1].state == S.GENERATION_STATE_SUCCEEDED
            assert a[-1].image.png == b[-1].image.png
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(other)
            assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert c.ar.prefills == ["dup"]

    run(body())


def test_rejected_admission_frees_the_request_id() -> None:
    async def body() -> None:
        async with cluster(max_tokens=8) as c:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(c.api.Generate(request("far too long", request_id="retry", seed=1), timeout=5))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # Nothing was accepted under the id: a corrected request may use it.
            events = await collect(c.api.Generate(request("short", request_id="retry", seed=1), timeout=10))
            assert events[-1].state == S.GENERATION_STATE_SUCCEEDED

    run(body())


def test_finished_generations_survive_a_broker_restart(tmp_path: Path) -> None:
    from kvrelay.broker.core import BrokerCore
    from kvrelay.broker.orchestrator import Orchestrator

    from .harness import test_config

    journal = str(tmp_path / "broker.sqlite")

    async def body() -> None:
        async with cluster(journal_path=journal) as c:
            kept = (await collect(c.api.Generate(request(request_id="kept", seed=1), timeout=10)))[-1]
            c.ar.prefill_gate.clear()
            live = c.api.Generate(request(request_id="live", seed=2), timeout=10)
            await wait_until(lambda: "live" in c.ar.prefills, what="live prefilling")
            live.cancel()
            await wait_until(lambda: c.orchestrator.get("live").state.terminal, what="live cancelled")
            stopped = c.api.Generate(request(request_id="stopped", seed=3), timeout=10)
            await wait_until(lambda: "stopped" in c.ar.prefills, what="stopped prefilling")
            await c.orchestrator.stop()  # the broker stops with "stopped" live
            assert (await collect(stopped))[-1].error.reason == "BROKER_SHUTTING_DOWN"
        # A new broker process on the same journal.
        core = BrokerCore(journal, journal_synchronous="OFF")
        orch = Orchestrator(core, test_config(result_ttl_seconds=30))
        await orch.start()
        try:
            snap = orch.get("kept")
            assert snap.state.name == "SUCCEEDED" and snap.image is not None
            assert snap.image.png == kept.image.png
            assert snap.timings["total"] == pytest.approx(kept.timings.total_seconds)
            assert snap.params.seed == 1
            assert orch.get("live").state.name == "CANCELLED"
            with pytest.raises(KvRelayServerError):
                orch.get("stopped")  # not kept: a retry after the restart starts afresh
            # Past its retention it is forgotten, in memory and in the journal.
            orch.store._clock = lambda: time.monotonic() + 31  # noqa: SLF001 - drive retention time
            with pytest.raises(KvRelayServerError):
                orch.get("kept")
            assert core.journal.load().generations == {}
        finally:
            await orch.stop()
            core.close()

    run(body())


def test_request_ids_no_generation_can_have_are_refused_naming_the_field_on_every_rpc() -> None:
    """128 characters of [A-Za-z0-9._:~-] is the bound (kvrelay.limits). A longer id is refused by
    Generate, GetGeneration and CancelGeneration alike with INVALID_ARGUMENT naming request_id and
    its length, quoting only its first characters (Get/Cancel answered NOT_FOUND quoting the id)."""
    S = generation_pb2

    async def body() -> None:
        async with cluster() as c:
            longest = "k" * 128
            events = await collect(c.api.Generate(request(request_id=longest, seed=1), timeout=10))
            assert events[-1].state == S.GENERATION_STATE_SUCCEEDED and events[-1].request_id == longest
            got = await c.api.GetGeneration(S.GetGenerationRequest(request_id=longest), timeout=5)
            assert got.generation.request_id == longest
            huge = "a" * 5000
            calls = {
                "Generate": lambda rid: collect(c.api.Generate(request(request_id=rid), timeout=10)),
                "GetGeneration": lambda rid: c.api.GetGeneration(S.GetGenerationRequest(request_id=rid), timeout=5),
                "CancelGeneration": lambda rid: c.api.CancelGeneration(
                    S.CancelGenerationRequest(request_id=rid), timeout=5
                ),
            }
            bound = "request_id: at most 128 characters of [A-Za-z0-9._:~-], got "
            cases = (
                ("k" * 129, bound + "129 characters: '" + "k" * 40 + "'..."),
                ("a b", bound + "'a b'"),
                # Far past it the interceptor refuses first (kvrelay.security.check_id_lengths),
                # with the same bound and words (kvrelay/limits.py): before, "longer than 256".
                (huge, bound + "5000 characters: '" + "a" * 40 + "'..."),
            )
            for name, call in calls.items():
                for rid, message in cases:
                    with pytest.raises(grpc.aio.AioRpcError) as exc:
                        await call(rid)
                    code, reason, metadata = error_info(exc.value)
                    assert (code, reason, metadata.get("field")) == (
                        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "request_id"
                    ), name
                    assert exc.value.details() == message, name
            # An empty id: Generate assigns one; Get/Cancel have nothing to look up.
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await c.api.GetGeneration(S.GetGenerationRequest(request_id=""), timeout=5)
            assert error_info(exc.value)[:2] == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
            await c.wait_pool_free()

    run(body())
