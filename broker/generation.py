"""GenerationService: the public API of kvrelay (DESIGN.md section 8), a grpc.aio servicer.

Owns input validation (every error names its field), the defaults of the seed's workload, the
proto <-> record conversions, and the detach rule: a Generate stream that ends before its
generation (cancelled or dropped) cancels it (CLIENT_DISCONNECTED) once no other stream follows it
and the stream's `detach_timeout_seconds` passed without a re-attach; 0, the default, cancels at
once (as vLLM aborts a request on disconnect). Everything else is the orchestrator's: this module
decides nothing about replicas, pages or tickets.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import math
import re
import secrets
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Final

import grpc
from google.protobuf import timestamp_pb2

from kvrelay.broker.generations import (
    CLIENT_DEADLINE_SLACK_S,
    ErrorInfo,
    GenerationParams,
    GenerationRecord,
    GenerationSnapshot,
    GenState,
    ListKey,
)
from kvrelay.broker.orchestrator import Orchestrator
from kvrelay.broker.service import revealable
from kvrelay.broker.tickets import BrokerError
from kvrelay.broker.wire import wire_enum
from kvrelay.config import DEFAULT_IMAGE_REPLY_BUDGET_BYTES, DEFAULT_IMAGE_REPLY_WAIT_SECONDS, BrokerConfig
from kvrelay.errors import KvRelayServerError, abort_with, invalid_argument, time_remaining
from kvrelay.limits import (
    MAX_LIST_PAGE_SIZE,
    MAX_PROMPT_BYTES,
    guidance_problem,
    list_page_size,
    request_id_problem,
    side_problem,
    steps_problem,
)
from kvrelay.logging import bind_request, get_logger
from kvrelay.security import current_caller, peer_key
from kvrelay.v1 import common_pb2, generation_pb2, generation_pb2_grpc

log = get_logger(__name__)

# The seed's acceptance workload (DESIGN.md section 8).
DEFAULT_WIDTH: Final = 512
DEFAULT_HEIGHT: Final = 512
DEFAULT_STEPS: Final = 2
DEFAULT_GUIDANCE: Final = 2.0
# MAX_PROMPT_BYTES (kvrelay.limits): the AR's max tokens is the real bound (checked by Tokenize);
# this only keeps megabytes of text from being shipped to a replica just to be refused.
# Seeds are drawn below 2**63 so that every consumer (torch generators take int64) accepts them.
_SEED_BITS: Final = 63
# How long a generation may wait for a re-attach after its stream ended (the deadline bounds it too).
MAX_DETACH_SECONDS: Final = 3600.0
# A ListGenerations reply stops before this many bytes: gRPC's default receive limit, so any stock
# client (grpcurl, another language's stub) can read it although retained prompts may be 1 MiB each.
MAX_LIST_REPLY_BYTES: Final = 4 * 1024 * 1024
# Generate streams that may follow one generation at once (re-attaching clients, a dashboard);
# one more is RESOURCE_EXHAUSTED TOO_MANY_STREAMS. Attaching needs only the request_id and
# parameters, and each stream held ~25 KB of the broker: one client could attach without bound.
MAX_STREAMS_PER_GENERATION: Final = 16
# PNG bytes that replies carrying an image (GetGeneration, a terminal Generate event) may hold at
# once, from being built until their call ends. gRPC keeps a reply until the peer has read it, at
# about 3x its PNG (the proto's copy, the serialized message, gRPC's buffer): unbounded, one
# connection that asked for a finished 2048x2048 image (10 MB PNG) over and over and never read
# pinned ~35 MB per call (50 calls: +1.7 GB), up to 1024 calls per connection.
# The defaults; a deployment sets them as broker.image_reply_budget_bytes and
# broker.image_reply_wait_seconds (docs/configuration.md).
MAX_IMAGE_REPLY_BYTES: Final = DEFAULT_IMAGE_REPLY_BUDGET_BYTES
# One peer host holds at most this fraction (1/N) of that budget (ImageReplyBudget).
PEER_SHARE_DIVISOR: Final = 4
# How long a reply waits for that budget (or less, the call's deadline) before RESOURCE_EXHAUSTED.
IMAGE_REPLY_WAIT_SECONDS: Final = DEFAULT_IMAGE_REPLY_WAIT_SECONDS
# A repeated message field's tag and length prefix (a length below 2**28 takes at most 4 bytes).
_LIST_ITEM_OVERHEAD: Final = 5
# Generations one ListGenerations call looks at, at most: with `states` filtering, a page that
# finds fewer than page_size before this ends there, with a next_page_token. So a call costs
# O(page) whatever the broker holds (before: every call sorted and copied every generation held,
# and a public caller's copied every retained prompt, 1 MiB each at most, just to blank it: a
# flood of them took the broker's loop, found black-box, a health check took 4.9 s).
MAX_LIST_SCAN: Final = 4 * MAX_LIST_PAGE_SIZE
# A finished generation's full listing view (prompts included) is kept for the next listing up
# to this size; the redacted view (no prompts, ~100 bytes) always is.
MAX_CACHED_VIEW_BYTES: Final = 16 * 1024
# Longest page_token taken (the broker's own are ~60 characters).
MAX_PAGE_TOKEN_CHARS: Final = 256
_PAGE_TOKEN_VERSION: Final = "g1"
# An error reason a redacted view keeps (UPPER_SNAKE, as every reason the broker sets); any other
# text (a replica's own, say) is shown as UNKNOWN.
_REASON: Final = re.compile(r"[A-Z][A-Z0-9_]{0,63}")

# Built by name from the proto and checked both ways (broker/wire.py).
_STATE = wire_enum(GenState, generation_pb2.GenerationState, "GENERATION_STATE_")
_STATE_FROM_PB, _STATE_TO_PB = _STATE.from_pb, _STATE.to_pb


def check_request_id(request_id: str) -> None:
    """INVALID_ARGUMENT for an id no generation can have (too long, other characters, empty):
    Get/CancelGeneration refuse it as Generate does, not NOT_FOUND with the id quoted whole."""
    if (problem := request_id_problem(request_id)) is not None:
        raise invalid_argument("request_id", problem)


def resolve_request(request: generation_pb2.GenerateRequest) -> tuple[str, GenerationParams, bool]:
    """(request_id, resolved params, whether the client chose the seed), or INVALID_ARGUMENT."""
    request_id = request.request_id or uuid.uuid4().hex
    check_request_id(request_id)
    if not request.prompt.strip():
        raise invalid_argument("prompt", "must not be empty")
    for name in ("prompt", "negative_prompt"):
        size = len(getattr(request, name).encode())
        if size > MAX_PROMPT_BYTES:
            raise invalid_argument(name, f"{size} bytes; at most {MAX_PROMPT_BYTES}")
    width = request.width if request.HasField("width") else DEFAULT_WIDTH
    height = request.height if request.HasField("height") else DEFAULT_HEIGHT
    steps = request.num_inference_steps if request.HasField("num_inference_steps") else DEFAULT_STEPS
    guidance = request.guidance_scale if request.HasField("guidance_scale") else DEFAULT_GUIDANCE
    # The bounds the SDK checks too (kvrelay/limits.py); a uint64 seed needs none.
    for name, problem in (
        ("width", side_problem(width)),
        ("height", side_problem(height)),
        ("num_inference_steps", steps_problem(steps)),
        ("guidance_scale", guidance_problem(guidance)),
    ):
        if problem is not None:
            raise invalid_argument(name, problem)
    seed_given = request.HasField("seed")
    seed = request.seed if seed_given else secrets.randbits(_SEED_BITS)
    params = GenerationParams(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        seed=seed,
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=guidance,
    )
    return request_id, params, seed_given


def resolve_detach_timeout(request: generation_pb2.GenerateRequest) -> float:
    """Seconds the generation outlives this stream waiting for a re-attach, or INVALID_ARGUMENT."""
    seconds = request.detach_timeout_seconds
    if not math.isfinite(seconds) or not 0.0 <= seconds <= MAX_DETACH_SECONDS:
        raise invalid_argument(
            "detach_timeout_seconds", f"must be in [0, {MAX_DETACH_SECONDS:g}], got {seconds}"
        )
    return seconds


# ------------------------------------------------------------------ conversions


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _timings(snap: GenerationSnapshot) -> common_pb2.PhaseTimings:
    return common_pb2.PhaseTimings(**{f"{phase}_seconds": value for phase, value in snap.timings.items()})


def _image(snap: GenerationSnapshot) -> common_pb2.Image | None:
    if snap.image is None:
        return None
    img = snap.image
    return common_pb2.Image(png=img.png, width=img.width, height=img.height, seed=img.seed)


def _error(snap: GenerationSnapshot) -> common_pb2.ErrorStatus | None:
    if snap.error is None:
        return None
    return common_pb2.ErrorStatus(code=snap.error.code, reason=snap.error.reason, message=snap.error.message)


def event_to_proto(snap: GenerationSnapshot) -> generation_pb2.GenerationEvent:
    """The image, timings and error ride only on the terminal event."""
    terminal = snap.state.terminal
    return generation_pb2.GenerationEvent(
        request_id=snap.request_id,
        state=_STATE_TO_PB[snap.state],
        step=snap.step,
        total_steps=snap.total_steps,
        image=_image(snap) if terminal else None,
        timings=_timings(snap) if terminal else None,
        error=_error(snap),
        ticket_id=snap.ticket_id,
        event_time=_timestamp(snap.update_time),
        attempt=snap.attempt,
    )


def generation_to_proto(snap: GenerationSnapshot, with_image: bool = True) -> generation_pb2.Generation:
    p = snap.params
    return generation_pb2.Generation(
        request_id=snap.request_id,
        state=_STATE_TO_PB[snap.state],
        params=generation_pb2.GenerationParams(
            prompt=p.prompt,
            negative_prompt=p.negative_prompt,
            seed=p.seed,
            width=p.width,
            height=p.height,
            num_inference_steps=p.num_inference_steps,
            guidance_scale=p.guidance_scale,
        ),
        step=snap.step,
        total_steps=snap.total_steps,
        image=_image(snap) if with_image else None,
        timings=_timings(snap),
        error=_error(snap),
        ticket_id=snap.ticket_id,
        create_time=_timestamp(snap.create_time),
        update_time=_timestamp(snap.update_time),
        attempt=snap.attempt,
    )


def _redacted_error(error: ErrorInfo | None) -> common_pb2.ErrorStatus | None:
    """The error as anyone may see it: its code and reason, never its message (free text that
    names tickets, replicas, hosts and paths)."""
    if error is None:
        return None
    code = error.code if error.code in grpc.StatusCode.__members__ else "UNKNOWN"
    reason = error.reason if _REASON.fullmatch(error.reason) else "UNKNOWN"
    return common_pb2.ErrorStatus(code=code, reason=reason)


def redacted_generation_to_proto(snap: GenerationSnapshot) -> generation_pb2.Generation:
    """A generation as a caller that is neither an operator nor holds its request_id sees it in
    a listing. Built from an allow-list, never by blanking a full view: no request_id (the
    capability of Get/CancelGeneration), ticket_id, prompt, negative prompt or error message
    (which names tickets, replicas and addresses), and no image."""
    p = snap.params
    return generation_pb2.Generation(
        state=_STATE_TO_PB[snap.state],
        params=generation_pb2.GenerationParams(
            seed=p.seed,
            width=p.width,
            height=p.height,
            num_inference_steps=p.num_inference_steps,
            guidance_scale=p.guidance_scale,
        ),
        step=snap.step,
        total_steps=snap.total_steps,
        timings=_timings(snap),
        error=_redacted_error(snap.error),
        create_time=_timestamp(snap.create_time),
        update_time=_timestamp(snap.update_time),
        attempt=snap.attempt,
    )


def _list_view(record: GenerationRecord, redact: bool) -> tuple[generation_pb2.Generation, int]:
    """`record` as a listing shows it, and its size. A finished generation never changes again:
    its views are built once and kept with the record (GenerationRecord.list_views)."""
    key = "redacted" if redact else "full"
    if (view := record.list_views.get(key)) is not None:
        return view  # type: ignore[no-any-return]
    snap = record.snapshot()
    generation = redacted_generation_to_proto(snap) if redact else generation_to_proto(snap, with_image=False)
    view = (generation, generation.ByteSize())
    # A full view holds a copy of the prompts (up to 2 MiB): kept only when small, so retained
    # generations never hold their prompts twice (a page of large ones is rebuilt, and the 4 MiB
    # reply bound keeps that page short).
    if record.state.terminal and (redact or view[1] <= MAX_CACHED_VIEW_BYTES):
        record.list_views[key] = view
    return view


# ---------------------------------------------------------------------- list pages


class PageTokens:
    """ListGenerations' page tokens: where the next page starts (the last listed generation's
    ListKey), the states it was given for, and this broker process's epoch. Opaque to callers and
    naming no generation (a request_id is a capability): forging one only picks a place to list
    from. A ListKey's clock is this process's, so a token of another process is refused."""

    def __init__(self, epoch: str | None = None) -> None:
        self.epoch = epoch or secrets.token_hex(4)

    @staticmethod
    def _states(states: list[GenState]) -> str:
        return "-".join(str(int(s)) for s in sorted(set(states))) or "all"

    def encode(self, after: ListKey, states: list[GenState]) -> str:
        fields = (_PAGE_TOKEN_VERSION, self.epoch, str(after[1]), after[0].hex(), self._states(states))
        text = ":".join(fields)
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    def decode(self, token: str, states: list[GenState]) -> ListKey | None:
        """Where the page `token` asks for starts (None: the first page), or INVALID_ARGUMENT."""
        if not token:
            return None
        if len(token) > MAX_PAGE_TOKEN_CHARS:
            raise invalid_argument("page_token", f"{len(token)} characters; a page token has at most "
                                   f"{MAX_PAGE_TOKEN_CHARS}: pass next_page_token of the previous reply unchanged")  # fmt: skip
        try:
            text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode("ascii")
            version, epoch, seq, mono, given_states = text.split(":")
            after = (float.fromhex(mono), int(seq))
            if version != _PAGE_TOKEN_VERSION or not math.isfinite(after[0]):
                raise ValueError(version)
        except (ValueError, binascii.Error, UnicodeDecodeError):
            raise invalid_argument(
                "page_token",
                "not a page token of ListGenerations: pass next_page_token of the previous "
                "reply unchanged, or leave it empty for the first page",
            ) from None
        if epoch != self.epoch:
            raise invalid_argument(
                "page_token",
                "given by another broker process (this one restarted since): list again from "
                "the first page (page_token empty)",
            )
        if given_states != self._states(states):
            raise invalid_argument(
                "page_token",
                "given for other states than these: pass the same states as the call that "
                "returned it, or leave it empty for the first page",
            )
        return after


def list_states(values: Any) -> list[GenState]:
    """The states a ListGenerations asks for, or INVALID_ARGUMENT (an unknown value, or more
    values than there are states: a request may carry millions, each one loop step)."""
    if len(values) > len(_STATE_FROM_PB):
        problem = f"{len(values)} values; at most {len(_STATE_FROM_PB)} (each state once)"
        raise invalid_argument("states", problem)
    states = []
    for value in values:
        if value not in _STATE_FROM_PB:
            raise invalid_argument("states", f"{value} is not a generation state")
        states.append(_STATE_FROM_PB[value])
    return states


# ---------------------------------------------------------------------- image replies


class ImageReplyBudget:
    """The PNG bytes of replies built but whose call has not ended, bounded by `limit_bytes`.

    `reserve` is called before a reply with an image is built; the bytes come back when the
    call ends (sent and read, cancelled, disconnected, past its deadline), so a reply its peer
    never reads keeps its share until then instead of every such call pinning its own copy.
    Waiters are served in arrival order; one that does not fit within its wait is refused
    RESOURCE_EXHAUSTED IMAGE_REPLY_BUDGET_EXHAUSTED. A single image larger than the whole
    budget is let through when nothing else is held.

    One peer (client host) holds at most a quarter of the budget: its further replies wait for
    its own to end, and neither take the rest nor hold up other peers' replies. Before, one api
    client that left a few calls for a large image unread (a raw HTTP/2 peer that announces a
    window of 0) took the whole budget for as long as it kept the connection, and every other
    client's image (a terminal Generate event, GetGeneration) failed IMAGE_REPLY_BUDGET_EXHAUSTED
    (found black-box). Peers behind one proxy count as one.
    """

    def __init__(self, limit_bytes: int | None = None, wait_seconds: float | None = None) -> None:
        self.limit_bytes = MAX_IMAGE_REPLY_BYTES if limit_bytes is None else limit_bytes
        self.wait_seconds = IMAGE_REPLY_WAIT_SECONDS if wait_seconds is None else wait_seconds
        self.held_bytes = 0
        # Bytes held per peer host (calls whose context names no peer are not counted per peer).
        self.held_by_peer: dict[str, int] = {}
        self._waiters: deque[tuple[int, str | None, asyncio.Future[None]]] = deque()

    @property
    def peer_limit_bytes(self) -> int:
        return max(1, self.limit_bytes // PEER_SHARE_DIVISOR)

    @classmethod
    def from_config(cls, broker: BrokerConfig) -> ImageReplyBudget:
        return cls(broker.image_reply_budget_bytes, broker.image_reply_wait_seconds)

    async def reserve(self, nbytes: int, context: grpc.aio.ServicerContext) -> None:
        """Hold `nbytes` until `context`'s call ends; waits at most `wait_seconds` (or the
        call's remaining time) for them."""
        if nbytes <= 0:
            return
        peer = _peer_host_of(context)
        # Arrival order: behind any waiter that waits for the budget (not for its own peer's share).
        if self._fits(nbytes, peer) and not any(self._fits_peer(size, p) for size, p, _ in self._waiters):
            self._take(nbytes, peer)
        else:
            await self._wait(nbytes, peer, context)
        released = False

        def release(_: Any = None) -> None:
            nonlocal released
            if not released:
                released = True
                self._release(nbytes, peer)

        context.add_done_callback(release)
        # A call that ended before the callback was added never calls it.
        if context.done():
            release()

    async def _wait(self, nbytes: int, peer: str | None, context: grpc.aio.ServicerContext) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((nbytes, peer, waiter))
        remaining = context.time_remaining()
        timeout = self.wait_seconds if remaining is None else min(self.wait_seconds, remaining)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except BaseException:
            with contextlib.suppress(ValueError):
                self._waiters.remove((nbytes, peer, waiter))
            if waiter.done() and not waiter.cancelled():
                self._release(nbytes, peer)  # granted as the wait ended: give it to the next
            waiter.cancel()
            if _cancelling():
                raise
            raise KvRelayServerError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "IMAGE_REPLY_BUDGET_EXHAUSTED",
                f"the broker holds {self.held_bytes} bytes of images in replies not yet read "
                f"(at most {self.limit_bytes}); retry later",
            ) from None

    def _fits_total(self, nbytes: int) -> bool:
        return self.held_bytes == 0 or self.held_bytes + nbytes <= self.limit_bytes

    def _fits_peer(self, nbytes: int, peer: str | None) -> bool:
        held = 0 if peer is None else self.held_by_peer.get(peer, 0)
        return held == 0 or held + nbytes <= self.peer_limit_bytes

    def _fits(self, nbytes: int, peer: str | None) -> bool:
        return self._fits_total(nbytes) and self._fits_peer(nbytes, peer)

    def _take(self, nbytes: int, peer: str | None) -> None:
        self.held_bytes += nbytes
        if peer is not None:
            self.held_by_peer[peer] = self.held_by_peer.get(peer, 0) + nbytes

    def _release(self, nbytes: int, peer: str | None) -> None:
        assert self.held_bytes >= nbytes, f"image reply budget: releasing {nbytes} of {self.held_bytes} held"
        self.held_bytes -= nbytes
        if peer is not None:
            left = self.held_by_peer[peer] - nbytes
            if left:
                self.held_by_peer[peer] = left
            else:
                del self.held_by_peer[peer]
        # In arrival order; a waiter over its peer's share waits for its peer without holding up
        # the others, and the first that does not fit the whole budget stops the round.
        for entry in list(self._waiters):
            size, owner, waiter = entry
            if waiter.done():
                self._waiters.remove(entry)
                continue
            if not self._fits_peer(size, owner):
                continue
            if not self._fits_total(size):
                break
            self._waiters.remove(entry)
            self._take(size, owner)
            waiter.set_result(None)


def _peer_host_of(context: Any) -> str | None:
    """The peer's host ("ipv4:10.0.0.2:5000" -> "10.0.0.2"), or None when the call names none."""
    peer = getattr(context, "peer", None)
    if peer is None:
        return None
    text = str(peer() or "")
    kind, _, rest = text.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0]
    return text or None


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _image_bytes(snap: GenerationSnapshot) -> int:
    return len(snap.image.png) if snap.image is not None else 0


# ---------------------------------------------------------------------- servicer


def _server_error(err: BrokerError) -> KvRelayServerError:
    return KvRelayServerError(grpc.StatusCode[err.code], err.reason, err.message)


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Every GenerationService RPC over one Orchestrator."""

    def __init__(self, orchestrator: Orchestrator, image_budget: ImageReplyBudget | None = None) -> None:
        self.orchestrator = orchestrator
        # The deployment's bounds (broker.image_reply_budget_bytes, image_reply_wait_seconds).
        self.image_budget = image_budget or ImageReplyBudget.from_config(orchestrator.cfg.broker)
        # Generations whose last stream ended early, waiting for a re-attach: the task cancels
        # them when none comes in time, and ends (holding nothing) as soon as they end anyway.
        self._detached: dict[str, asyncio.Task[None]] = {}
        self.page_tokens = PageTokens()

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerationEvent]:
        try:
            request_id, params, seed_given = resolve_request(request)
            detach_seconds = resolve_detach_timeout(request)
            # The client's deadline bounds the whole generation, queueing included.
            timeout = time_remaining(context)
            # Whose share of the queue it takes (broker.max_queue_per_client): the caller's
            # verified identity, else its peer address (the api token names no client).
            caller, peer = current_caller(), str(context.peer() or "")
            client = caller.key(peer) if caller is not None else peer_key(peer)
            record = await self.orchestrator.submit(
                request_id, params, seed_given=seed_given, timeout=timeout, client=client
            )
            if len(record.subscribers) >= MAX_STREAMS_PER_GENERATION:
                raise KvRelayServerError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_STREAMS",
                    f"generation {request_id!r} already has {len(record.subscribers)} Generate streams "
                    f"(at most {MAX_STREAMS_PER_GENERATION}); follow it with GetGeneration",
                )
        except KvRelayServerError as err:
            await abort_with(context, err)
        except BrokerError as err:
            await abort_with(context, _server_error(err))
        queue = record.subscribe()
        self._reattached(request_id)
        finished = False
        with bind_request(request_id=request_id):
            try:
                while True:
                    snap = await queue.get()
                    if snap.state.terminal:
                        try:
                            await self.image_budget.reserve(_image_bytes(snap), context)
                        except KvRelayServerError as err:
                            await abort_with(context, err)
                    await revealable(self.orchestrator.core, context)
                    yield event_to_proto(snap)
                    if snap.state.terminal:
                        finished = True
                        return
            finally:
                # Whatever ends this handler early (client cancel, dropped connection, deadline,
                # server stop) ends the generation: nobody is left to receive its image.
                record.unsubscribe(queue)
                if not finished and not record.state.terminal:
                    remaining = context.time_remaining()
                    if remaining is not None and remaining <= CLIENT_DEADLINE_SLACK_S:
                        self.orchestrator.expire(request_id)
                    else:
                        self._detach(record, detach_seconds)

    # ------------------------------------------------------------------ detach

    def _detach(self, record: GenerationRecord, seconds: float) -> None:
        """The stream of a live generation ended early: cancel it now, after `seconds` without a
        re-attach, or not at all while another stream still follows it."""
        if record.subscribers:
            log.info("generate_stream_dropped", streams_left=len(record.subscribers))
            return
        if seconds <= 0:
            log.info("generate_stream_dropped")
            self._disconnected(record, "the client cancelled or dropped the Generate stream")
            return
        log.info("generate_stream_detached", detach_timeout_seconds=seconds)
        self._reattached(record.request_id)
        self._detached[record.request_id] = asyncio.get_running_loop().create_task(
            self._await_reattach(record, seconds), name=f"detached-{record.request_id}"
        )

    def _reattached(self, request_id: str) -> None:
        waiting = self._detached.pop(request_id, None)
        if waiting is not None:
            waiting.cancel()

    async def _await_reattach(self, record: GenerationRecord, seconds: float) -> None:
        """Cancel `record` unless a stream re-attaches within `seconds` or it ends first. Ends with
        the generation: a timer kept the finished record (its image included) for the whole
        detach timeout, past result_ttl_seconds and max_results (found black-box: generations
        with detach_timeout_seconds 3600 whose streams dropped at once stayed in memory an hour)."""
        try:
            await asyncio.wait_for(record.done.wait(), seconds)
        except TimeoutError:
            if not record.subscribers:
                with contextlib.suppress(KvRelayServerError):  # it ended meanwhile: nothing to cancel
                    self._disconnected(
                        record, f"no client re-attached within {seconds:g} s of the Generate stream ending"
                    )
        finally:
            if self._detached.get(record.request_id) is asyncio.current_task():
                del self._detached[record.request_id]

    def _disconnected(self, record: GenerationRecord, message: str) -> None:
        if record.state.terminal or self.orchestrator.store.find(record.request_id) is not record:
            return
        self.orchestrator.cancel(record.request_id, "CLIENT_DISCONNECTED", message)

    async def GetGeneration(
        self, request: generation_pb2.GetGenerationRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetGenerationResponse:
        try:
            check_request_id(request.request_id)
            snap = self.orchestrator.get(request.request_id)
            await self.image_budget.reserve(_image_bytes(snap), context)
        except KvRelayServerError as err:
            await abort_with(context, err)
        await revealable(self.orchestrator.core, context)
        return generation_pb2.GetGenerationResponse(generation=generation_to_proto(snap))

    async def CancelGeneration(
        self, request: generation_pb2.CancelGenerationRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.CancelGenerationResponse:
        try:
            check_request_id(request.request_id)
            snap = self.orchestrator.cancel(request.request_id)
        except KvRelayServerError as err:
            await abort_with(context, err)
        await revealable(self.orchestrator.core, context)
        return generation_pb2.CancelGenerationResponse(generation=generation_to_proto(snap))

    async def ListGenerations(
        self, request: generation_pb2.ListGenerationsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ListGenerationsResponse:
        """One page, newest first: O(page_size) of the broker's loop however many generations it
        holds (GenerationStore.list_page bounds the walk, finished generations' views are built
        once), and a reply below MAX_LIST_REPLY_BYTES whatever their prompts."""
        try:
            states = list_states(request.states)
            page_size = list_page_size(request.page_size)
            after = self.page_tokens.decode(request.page_token, states)
        except KvRelayServerError as err:
            await abort_with(context, err)
        # A request_id is the capability of Get/CancelGeneration, and prompts are the clients':
        # only an operator (or anyone in a development deployment) sees them in a listing.
        caller = current_caller()
        redact = caller is not None and not caller.operator
        page = self.orchestrator.list_page(states, page_size, after, MAX_LIST_SCAN)
        next_after = page.next_after
        listed: list[generation_pb2.Generation] = []
        size = 0
        for index, record in enumerate(page.records):
            generation, nbytes = _list_view(record, redact)
            size += nbytes + _LIST_ITEM_OVERHEAD
            if size > MAX_LIST_REPLY_BYTES and listed:
                # The newest that fit (one always does: two prompts of at most 1 MiB each); the
                # next page starts after the last of them.
                next_after = page.records[index - 1].list_key
                break
            listed.append(generation)
        reply = generation_pb2.ListGenerationsResponse(generations=listed)
        if next_after is not None:
            reply.next_page_token = self.page_tokens.encode(next_after, states)
        await revealable(self.orchestrator.core, context)
        return reply


def add_generation_servicer(orchestrator: Orchestrator, server: grpc.aio.Server) -> GenerationServicer:
    servicer = GenerationServicer(orchestrator)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    return servicer


__all__ = [
    "GenerationServicer",
    "add_generation_servicer",
    "event_to_proto",
    "generation_to_proto",
    "resolve_detach_timeout",
    "resolve_request",
]
