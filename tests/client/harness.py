"""Test harness: a real grpc.aio server implementing GenerationService and BrokerService.

It runs the public contract honestly for the SDK's tests (validation, idempotent request ids,
ALREADY_EXISTS, a staged pipeline with DENOISING steps, a real PNG, CancelGeneration, the broker's
detach rule (a stream that ends early cancels its generation once no stream follows it and its
`detach_timeout_seconds` passed without a re-attach; 0 = at once), deadlines, rich errors through
kvrelay.errors) without models,
and lets a test inject faults: UNAVAILABLE answers, a stream the server breaks, a bearer token.
It runs on its own event loop in a thread so blocking and asyncio clients can both talk to it.
"""

from __future__ import annotations

import asyncio
import io
import math
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf import timestamp_pb2
from PIL import Image

from kvrelay.errors import KvRelayServerError, abort_with, invalid_argument, not_found
from kvrelay.limits import DEFAULT_LIST_PAGE_SIZE, MAX_LIST_PAGE_SIZE
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc

_T = TypeVar("_T")
S = generation_pb2.GenerationState
TERMINAL = {S.GENERATION_STATE_SUCCEEDED, S.GENERATION_STATE_FAILED, S.GENERATION_STATE_CANCELLED}
OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def _now() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.GetCurrentTime()
    return ts


def make_png(width: int, height: int, seed: int, noise: bool) -> bytes:
    if noise:
        # Incompressible: a 2048x2048 one is ~12 MiB, past gRPC's 4 MiB default.
        image = Image.frombytes("RGB", (width, height), os.urandom(width * height * 3))
    else:
        image = Image.new("RGB", (width, height), (seed % 256, (seed >> 8) % 256, (seed >> 16) % 256))
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)
    return out.getvalue()


@dataclass
class Gen:
    generation: generation_pb2.Generation
    events: list[generation_pb2.GenerationEvent] = field(default_factory=list)
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    task: asyncio.Task[None] | None = None
    subscribers: int = 0
    cancel_reason: str = ""
    cancelled_by: str = ""  # "CancelGeneration" | "stream_dropped" | "detach_expired"
    detach_timer: asyncio.TimerHandle | None = None
    noise: bool = False


class Harness(generation_pb2_grpc.GenerationServiceServicer, broker_pb2_grpc.BrokerServiceServicer):
    def __init__(self) -> None:
        self.step_delay = 0.01
        self.generations: dict[str, Gen] = {}
        self.calls: Counter[str] = Counter()
        # method name -> how many more calls to answer UNAVAILABLE
        self.unavailable: Counter[str] = Counter()
        # Break the next Generate stream(s) with UNAVAILABLE after this many events.
        self.break_stream_after: int | None = None
        self.break_streams = 0
        self.token: str | None = None
        self.deadlines: dict[str, list[float | None]] = {}
        self.generate_requests: list[generation_pb2.GenerateRequest] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.replicas: list[broker_pb2.ReplicaInfo] = []
        self.forgotten_incarnations: list[broker_pb2.ForgottenIncarnation] = []
        self.pools: list[broker_pb2.PoolStatus] = []
        self.tickets: list[broker_pb2.Ticket] = []

    # -- plumbing -------------------------------------------------------------------------------

    async def _gate(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.calls[method] += 1
        self.deadlines.setdefault(method, []).append(context.time_remaining())
        if self.token is not None:
            metadata = dict(context.invocation_metadata() or ())
            if metadata.get("authorization") != f"Bearer {self.token}":
                await abort_with(
                    context,
                    KvRelayServerError(
                        grpc.StatusCode.UNAUTHENTICATED, "BAD_TOKEN", "missing or wrong token"
                    ),
                )
        if self.unavailable[method] > 0:
            self.unavailable[method] -= 1
            await abort_with(
                context,
                KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "REPLICA_DOWN", "injected: try again"),
            )

    @staticmethod
    def _resolve(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerationParams:
        params = generation_pb2.GenerationParams(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            seed=request.seed if request.HasField("seed") else 12345,
            width=request.width if request.HasField("width") else 512,
            height=request.height if request.HasField("height") else 512,
            num_inference_steps=request.num_inference_steps if request.HasField("num_inference_steps") else 2,
            guidance_scale=request.guidance_scale if request.HasField("guidance_scale") else 2.0,
        )
        if not params.prompt:
            raise invalid_argument("prompt", "must not be empty")
        for name in ("width", "height"):
            value = getattr(params, name)
            if value % 16 or not 64 <= value <= 2048:
                raise invalid_argument(name, f"must be a multiple of 16 in [64, 2048], got {value}")
        if not 1 <= params.num_inference_steps <= 1000:
            raise invalid_argument("num_inference_steps", "must be in [1, 1000]")
        if not math.isfinite(params.guidance_scale) or params.guidance_scale < 1.0:
            raise invalid_argument("guidance_scale", "must be finite and >= 1.0")
        return params

    async def _emit(self, gen: Gen, state: int, **fields: Any) -> None:
        g = gen.generation
        g.state = state
        for name in ("step", "total_steps"):
            if name in fields:
                setattr(g, name, fields[name])
        event = generation_pb2.GenerationEvent(
            request_id=g.request_id,
            state=state,
            step=g.step,
            total_steps=g.total_steps,
            ticket_id=g.ticket_id,
            event_time=_now(),
        )
        for name in ("image", "timings", "error"):
            if name in fields:
                getattr(g, name).CopyFrom(fields[name])
                getattr(event, name).CopyFrom(fields[name])
        g.update_time.CopyFrom(event.event_time)
        async with gen.cond:
            gen.events.append(event)
            gen.cond.notify_all()

    async def _pipeline(self, gen: Gen) -> None:
        p = gen.generation.params
        started = time.monotonic()
        try:
            await self._emit(gen, S.GENERATION_STATE_QUEUED)
            await asyncio.sleep(self.step_delay)
            await self._emit(gen, S.GENERATION_STATE_PREFILLING)
            await asyncio.sleep(self.step_delay)
            await self._emit(gen, S.GENERATION_STATE_TRANSFERRING)
            await asyncio.sleep(self.step_delay)
            if p.prompt.startswith("fail:"):
                # "fail:REASON" (DEADLINE_EXCEEDED) or "fail:CODE/REASON", then optionally
                # "|MESSAGE" (what a replica or a rogue server said).
                spec, _, message = p.prompt[5:].partition("|")
                code, _, reason = spec.rpartition("/")
                error = common_pb2.ErrorStatus(
                    code=code or "DEADLINE_EXCEEDED",
                    reason=reason,
                    message=message or "injected failure while transferring",
                )
                await self._emit(gen, S.GENERATION_STATE_FAILED, error=error)
                return
            for step in range(1, p.num_inference_steps + 1):
                await asyncio.sleep(self.step_delay)
                await self._emit(
                    gen, S.GENERATION_STATE_DENOISING, step=step, total_steps=p.num_inference_steps
                )
            png = await asyncio.to_thread(make_png, p.width, p.height, p.seed, gen.noise)
            total = time.monotonic() - started
            timings = common_pb2.PhaseTimings(
                queue_seconds=0.001,
                prefill_seconds=0.01,
                transfer_seconds=0.002,
                denoise_seconds=total / 2,
                decode_seconds=0.003,
                total_seconds=total,
            )
            image = common_pb2.Image(png=png, width=p.width, height=p.height, seed=p.seed)
            await self._emit(gen, S.GENERATION_STATE_SUCCEEDED, image=image, timings=timings)
        except asyncio.CancelledError:
            error = common_pb2.ErrorStatus(code="CANCELLED", reason=gen.cancel_reason, message="cancelled")
            await self._emit(gen, S.GENERATION_STATE_CANCELLED, error=error)

    async def _cancel(self, gen: Gen, reason: str, by: str) -> None:
        if gen.generation.state in TERMINAL or gen.task is None:
            return
        gen.cancel_reason, gen.cancelled_by = reason, by
        gen.task.cancel()
        await asyncio.gather(gen.task, return_exceptions=True)

    def _find(self, request_id: str) -> Gen:
        gen = self.generations.get(request_id)
        if gen is None:
            raise not_found("generation", request_id)
        return gen

    # -- GenerationService ----------------------------------------------------------------------

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._gate("Generate", context)
        self.generate_requests.append(request)
        try:
            params = self._resolve(request)
        except KvRelayServerError as err:
            await abort_with(context, err)
        detach = request.detach_timeout_seconds
        if not 0.0 <= detach <= 3600.0:
            await abort_with(context, invalid_argument("detach_timeout_seconds", "must be in [0, 3600]"))
        request_id = request.request_id or uuid.uuid4().hex
        gen = self.generations.get(request_id)
        start = 0
        if gen is not None:
            if gen.generation.params != params:
                await abort_with(
                    context,
                    KvRelayServerError(
                        grpc.StatusCode.ALREADY_EXISTS,
                        "REQUEST_ID_REUSED",
                        f"{request_id!r} has other parameters",
                    ),
                )
            start = max(0, len(gen.events) - 1)  # attach: the current state, then what follows
        else:
            generation = generation_pb2.Generation(
                request_id=request_id, params=params, ticket_id=f"t-{request_id}", create_time=_now()
            )
            gen = Gen(generation, noise=params.prompt == "noise")
            self.generations[request_id] = gen
            gen.task = asyncio.get_running_loop().create_task(self._pipeline(gen))
        gen.subscribers += 1
        if gen.detach_timer is not None:  # re-attached in time: the generation goes on
            gen.detach_timer.cancel()
            gen.detach_timer = None
        index, finished = start, False
        try:
            while True:
                async with gen.cond:
                    await gen.cond.wait_for(lambda i=index: len(gen.events) > i)
                event = gen.events[index]
                index += 1
                yield event
                if event.state in TERMINAL:
                    finished = True
                    return
                if (
                    self.break_stream_after is not None
                    and self.break_streams > 0
                    and index >= self.break_stream_after
                ):
                    self.break_streams -= 1
                    await abort_with(
                        context,
                        KvRelayServerError(
                            grpc.StatusCode.UNAVAILABLE, "STREAM_BROKEN", "injected: stream broken"
                        ),
                    )
        finally:
            gen.subscribers -= 1
            if not finished and gen.subscribers == 0 and gen.generation.state not in TERMINAL:
                # The broker's detach rule (broker/generation.py): at once, as vLLM aborts on
                # disconnect, or after the stream's detach timeout without a re-attach.
                if detach <= 0:
                    await self._cancel(gen, "CLIENT_DISCONNECTED", "stream_dropped")
                else:
                    gen.detach_timer = asyncio.get_running_loop().call_later(
                        detach, self._detach_expired, gen
                    )

    def _detach_expired(self, gen: Gen) -> None:
        gen.detach_timer = None
        if gen.subscribers == 0:
            task = asyncio.get_running_loop().create_task(
                self._cancel(gen, "CLIENT_DISCONNECTED", "detach_expired")
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def GetGeneration(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._gate("GetGeneration", context)
        try:
            gen = self._find(request.request_id)
        except KvRelayServerError as err:
            await abort_with(context, err)
        return generation_pb2.GetGenerationResponse(generation=gen.generation)

    async def CancelGeneration(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._gate("CancelGeneration", context)
        try:
            gen = self._find(request.request_id)
        except KvRelayServerError as err:
            await abort_with(context, err)
        await self._cancel(gen, "CANCELLED_BY_USER", "CancelGeneration")
        return generation_pb2.CancelGenerationResponse(generation=gen.generation)

    async def ListGenerations(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._gate("ListGenerations", context)
        gens = [g.generation for g in reversed(self.generations.values())]
        if request.states:
            gens = [g for g in gens if g.state in request.states]
        out = []
        # The broker's page: 0 asks for 100, more than 1000 is 1000 (broker/generation.py).
        for g in gens[: min(request.page_size or DEFAULT_LIST_PAGE_SIZE, MAX_LIST_PAGE_SIZE)]:
            copy = generation_pb2.Generation()
            copy.CopyFrom(g)
            copy.ClearField("image")
            out.append(copy)
        return generation_pb2.ListGenerationsResponse(generations=out)

    # -- BrokerService (the reads `kvrelay status` uses) ----------------------------------------

    async def ListReplicas(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._gate("ListReplicas", context)
        return broker_pb2.ListReplicasResponse(replicas=self.replicas, forgotten_incarnations=self.forgotten_incarnations)

    async def GetPool(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._gate("GetPool", context)
        pools = [p for p in self.pools if not request.replica_id or p.replica_id == request.replica_id]
        if request.replica_id and not pools:
            await abort_with(context, not_found("replica", request.replica_id))
        return broker_pb2.GetPoolResponse(pools=pools)

    async def ListTickets(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._gate("ListTickets", context)
        tickets = [
            t
            for t in self.tickets
            if (t.state in request.states if request.states else t.state != broker_pb2.TICKET_STATE_RELEASED)
            and (not request.replica_id or request.replica_id in (t.ar_replica_id, t.dit_replica_id))
        ]
        return broker_pb2.ListTicketsResponse(tickets=tickets)


class ServerThread:
    """Runs a Harness on a grpc.aio server (port 0) on its own event loop thread."""

    def __init__(self, harness: Harness, credentials: grpc.ServerCredentials | None = None) -> None:
        self.harness = harness
        self._credentials = credentials
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="harness-server", daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("harness server did not start")
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        self.loop.run_forever()

    async def _serve(self) -> None:
        server = grpc.aio.server(options=OPTIONS)
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(self.harness, server)
        broker_pb2_grpc.add_BrokerServiceServicer_to_server(self.harness, server)
        if self._credentials is not None:
            self.port = server.add_secure_port("127.0.0.1:0", self._credentials)
        else:
            self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server
        self._started.set()

    def call(self, fn: Callable[[], Awaitable[_T]], timeout: float = 10) -> _T:
        """Run a coroutine on the server's loop (to inspect or change its state safely)."""
        future: Future[_T] = asyncio.run_coroutine_threadsafe(fn(), self.loop)  # type: ignore[arg-type]
        return future.result(timeout)

    def generation(self, request_id: str) -> generation_pb2.Generation:
        async def get() -> generation_pb2.Generation:
            copy = generation_pb2.Generation()
            copy.CopyFrom(self.harness.generations[request_id].generation)
            return copy

        return self.call(get)

    def wait_for_state(self, request_id: str, state: int, timeout: float = 10) -> generation_pb2.Generation:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if request_id in self.harness.generations and self.generation(request_id).state == state:
                return self.generation(request_id)
            time.sleep(0.02)
        raise AssertionError(f"{request_id} never reached state {S.Name(state)}")

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                await self._server.stop(0.5)
            # Pipelines still running end here, on their loop: left pending, they are destroyed
            # when the loop is collected and asyncio logs "Task was destroyed but it is pending!"
            # into whatever test runs then (it broke a later test's stderr check once).
            current = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        if self._thread.is_alive():
            self.call(shutdown)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()
