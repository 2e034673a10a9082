"""The SDK core: every rule of calling, following, re-attaching and cancelling, once, with no I/O.

`sync.py` and `aio.py` are thin faces over it (as grpc's own sync and aio stubs, or temporalio's
client, share one core): they open streams, read messages, sleep and make calls, and ask this
module what each outcome means. This module never touches a channel, a socket, a thread or an
event loop; it takes events in (a message arrived, the stream ended with this error, the wait is
over, the cancel call answered) and hands decisions out (yield this event, raise this error, wait
this long, open the stream again, call CancelGeneration). So the rules are tested in-process
(tests/client/test_core.py) and the two faces cannot drift apart.

- `ClientSettings`: what a client was built with (deadline, token, retry policy, channel).
- `UnaryCall`: which RPC, what request, how its answer becomes a public value.
- `UnaryAttempts`: the retry rule of a unary call (idempotent calls only, on UNAVAILABLE, with
  backoff, within the deadline).
- `GenerationCore`: one submitted generation: follow, re-attach, cancel.
"""

from __future__ import annotations

import copy
import math
import numbers
import operator
import random
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Generic, Literal, TypeVar

import grpc

from kvrelay.limits import guidance_problem, request_id_problem, seed_problem, side_problem, steps_problem
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, generation_pb2, generation_pb2_grpc

from ._common import (
    DEFAULT_GENERATE_TIMEOUT,
    DEFAULT_RPC_TIMEOUT,
    DEFAULT_TARGET,
    KEEPALIVE_TIME,
    KEEPALIVE_TIMEOUT,
    Clock,
    Deadline,
    Reattach,
    RetryPolicy,
    call_metadata,
    channel_credentials,
    channel_options,
    normalize_target,
)
from .errors import KvRelayError
from .types import (
    CredentialsReload,
    ErrorStatus,
    Generation,
    GenerationEvent,
    GenerationPage,
    GenerationResult,
    GenerationState,
    PhaseTimings,
    PoolStatus,
    Replica,
    ReplicaRegistry,
    Ticket,
    TicketState,
    credentials_reload_from_pb,
    event_from_generation,
    event_from_pb,
    generation_from_pb,
    pool_from_pb,
    replica_from_pb,
    replica_registry_from_pb,
    ticket_from_pb,
)

_T = TypeVar("_T")

# The broker's bound on GenerateRequest.detach_timeout_seconds.
MAX_DETACH_SECONDS = 3600.0

# The longest `timeout=` (seconds, ~31.7 years; the servers hold longer deadlines to the same,
# kvrelay.errors.MAX_DEADLINE_SECONDS): gRPC keeps a deadline as int64 nanoseconds since the epoch.
MAX_TIMEOUT_SECONDS = 1e9

# Codes of a CancelGeneration that found nothing left to cancel (unknown id, or already ended).
NOTHING_TO_CANCEL = frozenset({"NOT_FOUND", "FAILED_PRECONDITION"})

Service = Literal["generation", "broker"]


# ------------------------------------------------------------------------------ a client


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """What a client was built with: the default deadline of unary calls, the call metadata
    (bearer token), the retry policy, and how to open its channel (credentials, options)."""

    target: str
    timeout: float
    metadata: tuple[tuple[str, str], ...] | None
    retry: RetryPolicy
    credentials: grpc.ChannelCredentials | None
    options: list[tuple[str, Any]]

    @classmethod
    def make(
        cls,
        target: str,
        token: str | None,
        tls: bool,
        timeout: float | None,
        root_certificates: bytes | None,
        retry: RetryPolicy | None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        keepalive_time: float | None = KEEPALIVE_TIME,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
    ) -> ClientSettings:
        return cls(
            target=target,
            timeout=checked_timeout(timeout) or DEFAULT_RPC_TIMEOUT,
            metadata=call_metadata(token),
            retry=retry or RetryPolicy(),
            credentials=channel_credentials(tls, root_certificates, certificate_chain, private_key),
            options=channel_options(keepalive_time, keepalive_timeout),
        )

    def attempts(self, call: UnaryCall[Any], timeout: float | None) -> UnaryAttempts:
        """The attempts of `call` within `timeout` (the client's default when None)."""
        deadline = Deadline(checked_timeout(timeout) or self.timeout)
        return UnaryAttempts(self.retry, deadline, call.idempotent)


class ClientBase:
    """The constructor both faces share; each face opens its kind of channel (`_open_channel`)."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        tls: bool = False,
        timeout: float | None = None,
        root_certificates: bytes | None = None,
        retry: RetryPolicy | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        keepalive_time: float | None = KEEPALIVE_TIME,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
    ) -> None:
        # A target without a port would dial 443: the broker's default port is meant.
        target = normalize_target(target)
        self.target = target
        self._settings = ClientSettings.make(
            target, token, tls, timeout, root_certificates, retry, certificate_chain, private_key,
            keepalive_time, keepalive_timeout,
        )
        # Set by close(): a call after it is a KvRelayError, never grpc's ValueError/UsageError.
        self._closed = False
        # Open Generate streams (the asyncio face cancels them itself on close()).
        self._open_calls: weakref.WeakSet[Any] = weakref.WeakSet()
        self._channel: Any = None
        self._stubs: dict[Service, Any] = {}
        if self._channel_at_construction:
            self._attach_channel(self._open_channel(self._settings))

    # The blocking face opens its channel here; the asyncio face on first use, in the running
    # loop (a grpc.aio channel belongs to the loop it was created on).
    _channel_at_construction = True

    def _open_channel(self, settings: ClientSettings) -> Any:
        raise NotImplementedError

    def _attach_channel(self, channel: Any) -> None:
        self._channel = channel
        self._stubs = {
            "generation": generation_pb2_grpc.GenerationServiceStub(channel),
            "broker": broker_pb2_grpc.BrokerServiceStub(channel),
        }

    def _check_open(self, request_id: str | None = None) -> None:
        if self._closed:
            raise client_closed_error(request_id)


# ------------------------------------------------------------------------------ unary calls


@dataclass(frozen=True, slots=True)
class UnaryCall(Generic[_T]):
    """One unary RPC: the stub (`service`) and `method` to call, the request, and `convert`, which
    turns the response into the public value. `request_id` names the generation in errors."""

    service: Service
    method: str
    request: Any
    convert: Callable[[Any], _T]
    idempotent: bool = True
    request_id: str | None = None


def get_generation(request_id: str) -> UnaryCall[Generation]:
    return UnaryCall(
        "generation",
        "GetGeneration",
        generation_pb2.GetGenerationRequest(request_id=wire_request_id(request_id)),
        lambda r: generation_from_pb(r.generation),
        request_id=request_id,
    )


def cancel_generation(request_id: str) -> UnaryCall[Generation]:
    # Idempotent on the server: a repeat finds the generation already CANCELLED.
    return UnaryCall(
        "generation",
        "CancelGeneration",
        generation_pb2.CancelGenerationRequest(request_id=wire_request_id(request_id)),
        lambda r: generation_from_pb(r.generation),
        request_id=request_id,
    )


def checked_timeout(value: float | None) -> float | None:
    """A `timeout=` (seconds): None, or a positive number up to MAX_TIMEOUT_SECONDS. Zero, a
    negative number or NaN can never be met, and one over the bound (1e10) cannot be held by gRPC
    (a deadline past 2262): each came back as DEADLINE_EXCEEDED "Deadline Exceeded" from every
    call, as if the server had been slow; refused here like a value the wire cannot carry."""
    if value is None:
        return None
    seconds = float(value)
    if not (seconds > 0 and math.isfinite(seconds) and seconds <= MAX_TIMEOUT_SECONDS):
        raise KvRelayError(
            "INVALID_ARGUMENT",
            "INVALID_ARGUMENT",
            f"timeout: must be a positive number of seconds, at most {MAX_TIMEOUT_SECONDS:g} "
            f"(None: the default), got {value}",
            {"field": "timeout"},
        )
    return seconds


def wire_text(field: str, value: str) -> str:
    """`value` for a proto string field: text that is not Unicode scalar values (a lone surrogate,
    which is how Python decodes bytes that are not UTF-8 from a command line, a file read with
    surrogateescape or a pipe) is refused here, like a value the wire cannot carry
    (INVALID_ARGUMENT naming the field), never protobuf's UnicodeEncodeError traceback. A value
    that is not a str is the caller's TypeError naming the field (protobuf's said "bad argument
    type for built-in operation", and None was taken as "")."""
    if not isinstance(value, str):
        raise TypeError(f"{field} must be str, not {type(value).__name__} {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(value[err.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise KvRelayError(
            "INVALID_ARGUMENT",
            "INVALID_ARGUMENT",
            f"{field}: not UTF-8 text ({what} at character {err.start})",
            {"field": field},
        ) from None
    return value


def wire_request_id(request_id: str) -> str:
    """`request_id` for the wire; one no generation can have (longer than the broker takes, other
    characters, empty) is refused here with the broker's own message (kvrelay.limits)."""
    text = wire_text("request_id", request_id)
    checked("request_id", request_id_problem(text))
    return text


def wire_integer(field: str, value: int) -> int:
    """`value` as an int; not an integer (a float, a str) is the caller's TypeError naming the
    field: `num_inference_steps=2.7` ran 2 steps and `seed=1.5` seed 1 without a word (found
    black-box)."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{field} must be an integer, not {type(value).__name__} {value!r}") from None


def checked(field: str, problem: str | None) -> None:
    """INVALID_ARGUMENT naming `field`, as the server words it, when a kvrelay.limits check found
    a problem."""
    if problem is not None:
        raise KvRelayError("INVALID_ARGUMENT", "INVALID_ARGUMENT", f"{field}: {problem}", {"field": field})


def wire_unsigned(field: str, value: int, bits: int) -> int:
    """`value` for an unsigned proto field; one it cannot carry is refused here, like the server
    would (INVALID_ARGUMENT naming the field), never protobuf's ValueError. Not an integer is the
    caller's TypeError naming the field (wire_integer)."""
    number = wire_integer(field, value)
    if not 0 <= number < 1 << bits:
        raise KvRelayError(
            "INVALID_ARGUMENT",
            "INVALID_ARGUMENT",
            f"{field}: must be in [0, 2**{bits}), got {value}",
            {"field": field},
        )
    return number


def list_generations(states: Iterable[GenerationState] | None, page_size: int) -> UnaryCall[list[Generation]]:
    return UnaryCall(
        "generation",
        "ListGenerations",
        generation_pb2.ListGenerationsRequest(
            states=enum_values(states, "GenerationState"), page_size=wire_unsigned("page_size", page_size, 32)
        ),
        lambda r: [generation_from_pb(g) for g in r.generations],
    )


def list_generations_page(
    states: Iterable[GenerationState] | None, page_size: int, page_token: str
) -> UnaryCall[GenerationPage]:
    return UnaryCall(
        "generation",
        "ListGenerations",
        generation_pb2.ListGenerationsRequest(
            states=enum_values(states, "GenerationState"),
            page_size=wire_unsigned("page_size", page_size, 32),
            page_token=wire_text("page_token", page_token),
        ),
        lambda r: GenerationPage([generation_from_pb(g) for g in r.generations], r.next_page_token),
    )


def list_replicas() -> UnaryCall[list[Replica]]:
    return UnaryCall(
        "broker",
        "ListReplicas",
        broker_pb2.ListReplicasRequest(),
        lambda r: [replica_from_pb(x) for x in r.replicas],
    )


def get_replica_registry() -> UnaryCall[ReplicaRegistry]:
    return UnaryCall("broker", "ListReplicas", broker_pb2.ListReplicasRequest(), replica_registry_from_pb)


def get_pools(replica_id: str) -> UnaryCall[list[PoolStatus]]:
    return UnaryCall(
        "broker",
        "GetPool",
        broker_pb2.GetPoolRequest(replica_id=wire_text("replica_id", replica_id)),
        lambda r: [pool_from_pb(p) for p in r.pools],
    )


def forget_replica(replica_id: str, force: bool) -> UnaryCall[list[str]]:
    # Not retried: a retry after a reply that was lost finds the replica forgotten (NOT_FOUND).
    return UnaryCall(
        "broker",
        "ForgetReplica",
        broker_pb2.ForgetReplicaRequest(replica_id=wire_text("replica_id", replica_id), force=force),
        lambda r: list(r.ended_ticket_ids),
        idempotent=False,
    )


def reload_credentials() -> UnaryCall[CredentialsReload]:
    # Retried like a read: a second reload finds the files unchanged and swaps nothing.
    return UnaryCall("broker", "ReloadCredentials", broker_pb2.ReloadCredentialsRequest(), credentials_reload_from_pb)


def list_tickets(states: Iterable[TicketState] | None, replica_id: str) -> UnaryCall[list[Ticket]]:
    return UnaryCall(
        "broker",
        "ListTickets",
        broker_pb2.ListTicketsRequest(states=enum_values(states, "TicketState"), replica_id=wire_text("replica_id", replica_id)),
        lambda r: [ticket_from_pb(t) for t in r.tickets],
    )


class UnaryAttempts:
    """The attempts of one unary call: `timeout()` before each, `failed(error)` after a failure
    answers how long to back off, or raises `error` when no attempt is left (not idempotent, not
    retryable, attempts spent, or the backoff would pass the deadline)."""

    def __init__(
        self,
        policy: RetryPolicy,
        deadline: Deadline,
        idempotent: bool,
        rng: random.Random | None = None,
    ) -> None:
        self._deadline = deadline
        self._backoffs = policy.backoffs(rng) if idempotent else iter(())

    def timeout(self) -> float | None:
        return self._deadline.remaining()

    def failed(self, error: KvRelayError) -> float:
        delay = next(self._backoffs, None) if error.retryable else None
        if delay is None or not self._deadline.allows_sleep(delay):
            raise raisable(error)
        return delay


# --------------------------------------------------------------------------- a generation


def raisable(error: KvRelayError) -> KvRelayError:
    """A fresh copy of `error`, to raise where `error` itself stays referenced (a core's
    `failure`, a `Fail`, a local of the raising frame).

    Raising gives an exception a traceback whose frames hold their locals: the handle, its core
    and its gRPC call. Raised itself, a stored error closed a reference cycle (handle -> core ->
    failure -> traceback -> frame -> handle) per failed generation, freed only by the cyclic GC:
    a load script whose generations fail fast (a broker restarting under it) kept the GC busy
    with ~30 objects of gRPC call state per failure. A copy carries no traceback, so nothing the
    caller drops stays alive; and two threads raising one failure do not rewrite each other's
    traceback.
    """
    return copy.copy(error)


def deadline_error(what: str, request_id: str | None = None) -> KvRelayError:
    return KvRelayError(
        "DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", f"{what}: deadline exceeded", request_id=request_id
    )


def result_from_event(event: GenerationEvent) -> GenerationResult:
    """The result carried by a terminal event, or the KvRelayError that FAILED/CANCELLED means."""
    if event.state == GenerationState.SUCCEEDED:
        if event.image is None:
            raise KvRelayError(
                "INTERNAL",
                "MISSING_IMAGE",
                "the generation succeeded without an image",
                request_id=event.request_id,
            )
        return GenerationResult(
            request_id=event.request_id,
            png=event.image.png,
            width=event.image.width,
            height=event.image.height,
            seed=event.image.seed,
            timings=event.timings or PhaseTimings(),
        )
    if event.error is not None:
        code, reason, message = event.error.code, event.error.reason, event.error.message
    elif event.state == GenerationState.CANCELLED:
        code, reason, message = "CANCELLED", "CANCELLED", "the generation was cancelled"
    else:
        code, reason, message = "UNKNOWN", "UNKNOWN", f"the generation ended in state {event.state.name}"
    if not code:
        code = "CANCELLED" if event.state == GenerationState.CANCELLED else "UNKNOWN"
    raise KvRelayError(code, reason, message, request_id=event.request_id)


def cancelled_by_client_event(request_id: str) -> GenerationEvent:
    return GenerationEvent(
        request_id=request_id,
        state=GenerationState.CANCELLED,
        error=ErrorStatus("CANCELLED", "CANCELLED_BY_CLIENT", "the generation was cancelled by this client"),
    )


def client_closed_error(request_id: str | None = None) -> KvRelayError:
    """A call made on (or a stream dropped by) a closed client."""
    return KvRelayError("CANCELLED", "CLIENT_CLOSED", "the client is closed", request_id=request_id)


# The reason of a generation the broker failed because it is stopping (not kept: re-attachable).
BROKER_STOPPING_REASON = "BROKER_SHUTTING_DOWN"


def stream_ended_error(request_id: str | None) -> KvRelayError:
    return KvRelayError(
        "UNAVAILABLE",
        "STREAM_ENDED",
        "the Generate stream ended before the generation finished",
        request_id=request_id,
    )


def stream_dropped_error(error: KvRelayError, request_id: str | None) -> KvRelayError:
    """A Generate call ended with a bare status CANCELLED that this client did not ask for.

    The broker never ends a Generate call so (a cancelled generation is a CANCELLED *event*):
    the server or a proxy dropped the call, as a stopping broker does to streams opened in its
    last milliseconds. Retryable, so a `request_id` re-attaches; "CANCELLED" would tell the
    caller that someone cancelled the generation.
    """
    return KvRelayError(
        "UNAVAILABLE",
        "STREAM_DROPPED",
        f"the server dropped the Generate stream (status CANCELLED: {error.message or 'no details'}); "
        "the broker may be restarting",
        request_id=request_id,
    )


def stream_cancelled_error(request_id: str | None, *, reattachable: bool) -> KvRelayError:
    """The Generate call was cancelled with an earlier reader's task (asyncio.wait_for,
    asyncio.timeout or Task.cancel around result() or events()): grpc.aio cancels a call whose
    read() is cancelled. The broker keeps a `request_id` generation for the re-attach window
    (retryable: the SDK re-attaches) and cancels one without at once (not retryable)."""
    if reattachable:
        return KvRelayError(
            "UNAVAILABLE", "STREAM_CANCELLED",
            "the Generate stream was cancelled with the task that read it (asyncio.wait_for, asyncio.timeout "
            "or Task.cancel around result() or events()); re-attaching by request_id",
            request_id=request_id,
        )  # fmt: skip
    return KvRelayError(
        "CANCELLED", "STREAM_CANCELLED",
        "the Generate stream was cancelled with the task that read it (asyncio.wait_for, asyncio.timeout or "
        "Task.cancel around result() or events()), and without a request_id the broker cancels a generation "
        "whose stream drops: pass request_id= to generate() to wait for it again after such a timeout",
        request_id=request_id,
    )  # fmt: skip


def enum_values(states: Iterable[IntEnum] | None, kind: str) -> Any:
    """Public IntEnums as the proto's enum numbers (the values are the same by construction).
    One state or a str instead of an iterable of them is the caller's TypeError (a str was read
    a character at a time: "invalid literal for int() with base 10: 'Q'")."""
    if isinstance(states, str | int) or not isinstance(states, Iterable | None):
        raise TypeError(f"states must be an iterable of {kind}, not {type(states).__name__} {states!r}")
    return [int(s) for s in states or ()]


@dataclass(frozen=True, slots=True)
class Finish:
    """Yield `event` (the terminal one) and stop following."""

    event: GenerationEvent


@dataclass(frozen=True, slots=True)
class Fail:
    """Raise `error`: the call failed and will not be re-attached."""

    error: KvRelayError


@dataclass(frozen=True, slots=True)
class Wait:
    """Sleep `seconds` (a cancel may cut it short), then ask `wait_over()`. `error` is why the
    stream ended (a face may tell its user what it waits out)."""

    seconds: float
    error: KvRelayError | None = None


@dataclass(frozen=True, slots=True)
class Reopen:
    """Open the Generate stream again with the same request: the server attaches to the
    generation it already runs under this request_id."""


StreamEnd = Finish | Fail | Wait
AfterWait = Finish | Reopen


@dataclass(frozen=True, slots=True)
class CancelPlan:
    """What `cancel()` does: call `call` when the id is known (else only drop the stream)."""

    call: UnaryCall[Generation] | None


class GenerationCore:
    """One generation as the client follows it: which events it saw, whether it ended, whether a
    broken stream is re-attached, and what a cancel means. Pure; the faces do the I/O.

    Re-attaching needs an id the server knows before the first event: only a caller-chosen
    `request_id` is re-attached. Such a request also carries `detach_timeout_seconds` (the
    policy's `reattach_seconds`), so the broker keeps the generation running that long after a
    broken stream, waiting for the re-attach (docs/api.md "Detaching and re-attaching").
    """

    def __init__(
        self,
        request: generation_pb2.GenerateRequest,
        deadline: Deadline,
        policy: RetryPolicy,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.request = request
        self.deadline = deadline
        self._policy = policy
        self._clock = clock
        self._rng = rng
        self._reattach_enabled = bool(request.request_id)
        self._window: Reattach | None = None
        self.request_id: str | None = request.request_id or None
        self.cancel_requested = False
        self._cancel_outcome: GenerationEvent | None = None
        self.last: GenerationEvent | None = None
        self.terminal: GenerationEvent | None = None
        # The error that ended the last follow (a later follow may still re-attach).
        self.failure: KvRelayError | None = None
        # A stopping broker's FAILED / BROKER_SHUTTING_DOWN, held back from the caller: the
        # stream's end is then that error, re-attached as a broken stream is.
        self._broker_stopping: KvRelayError | None = None

    @property
    def reattachable(self) -> bool:
        """Whether a broken stream is re-attached (the request carries a request_id)."""
        return self._reattach_enabled

    @property
    def done(self) -> bool:
        return self.terminal is not None

    # -- following ------------------------------------------------------------------------------

    def start_following(self) -> GenerationEvent | None:
        """A new `events()`/`result()` pass: a fresh re-attach window. Returns the terminal event
        when the generation already ended: the pass yields it again and nothing else (its stream
        is over; reading it would look like a stream that ended early)."""
        if self.terminal is not None:
            return self.terminal
        self.failure = None
        self._window = Reattach(self._policy, self.deadline, clock=self._clock, rng=self._rng)
        return None

    def on_message(self, message: generation_pb2.GenerationEvent) -> GenerationEvent | None:
        """A message arrived on the stream: the event to yield (stop after it when `done`), or
        None to yield nothing (read on)."""
        event = event_from_pb(message)
        if (
            self._reattach_enabled
            and event.state == GenerationState.FAILED
            and event.error is not None
            and event.error.reason == BROKER_STOPPING_REASON
        ):
            # The broker stopping keeps no live generation (docs/api.md, Retention): after its
            # restart a re-attach with this request_id starts it afresh, as after a crash.
            self._broker_stopping = KvRelayError(
                event.error.code, event.error.reason, event.error.message, request_id=self.request_id
            )
            return None
        self._broker_stopping = None
        self._observe(event)
        if self._window is not None:
            self._window.progressed()
        return event

    def on_stream_end(self, error: KvRelayError | None) -> StreamEnd:
        """The stream ended before a terminal event: with `error`, or cleanly (None)."""
        if self.cancel_requested:
            return self._finish_cancelled()
        if error is None:
            error = self._broker_stopping or stream_ended_error(self.request_id)
        elif error.code == "CANCELLED" and error.reason == "CANCELLED":  # not ours: checked above
            error = stream_dropped_error(error, self.request_id)
        if self.deadline.expired() and error.code != "DEADLINE_EXCEEDED":
            error = deadline_error("Generate", self.request_id)
        delay = None
        if self._reattach_enabled and error.retryable and self._window is not None:
            delay = self._window.next_delay(error)
        if delay is None:
            self.failure = error
            return Fail(error)
        return Wait(delay, error)

    def wait_over(self) -> AfterWait:
        """The backoff is over (or a cancel cut it short)."""
        if self.cancel_requested:
            return self._finish_cancelled()
        return Reopen()

    def result(self) -> GenerationResult:
        """The result of the terminal event (raises the KvRelayError of FAILED/CANCELLED)."""
        if self.terminal is None:
            raise RuntimeError("the generation has not ended")
        return result_from_event(self.terminal)

    # -- cancelling -----------------------------------------------------------------------------

    def begin_cancel(self) -> CancelPlan | None:
        """A cancel was asked for: None when there is nothing to do (ended, or already asked)."""
        if self.terminal is not None or self.cancel_requested:
            return None
        self.cancel_requested = True
        return CancelPlan(cancel_generation(self.request_id) if self.request_id else None)

    def cancel_answered(self, generation: Generation) -> None:
        """The server's word on how the generation ended (it may have finished before the cancel)."""
        if generation.state.is_terminal:
            self._cancel_outcome = event_from_generation(generation)

    def cancel_failed(self, error: KvRelayError) -> KvRelayError | None:
        """The cancel call failed: the error to raise once the stream is dropped, if any."""
        return None if error.code in NOTHING_TO_CANCEL else error

    # -- internals ------------------------------------------------------------------------------

    def _observe(self, event: GenerationEvent) -> None:
        if event.request_id:
            self.request_id = event.request_id
        self.last = event
        if event.state.is_terminal:
            self.terminal = event

    def _finish_cancelled(self) -> Finish:
        event = self._cancel_outcome or cancelled_by_client_event(self.request_id or "")
        self._observe(event)
        return Finish(event)


class HandleBase:
    """What both faces' handles read from their core."""

    _core: GenerationCore

    @property
    def request_id(self) -> str | None:
        """The generation's id: the caller's, or the server's once the first event arrived."""
        return self._core.request_id

    @property
    def last_event(self) -> GenerationEvent | None:
        """The latest event seen (None before the first)."""
        return self._core.last

    @property
    def done(self) -> bool:
        """Whether a terminal event was seen."""
        return self._core.done


def new_generation(
    prompt: str,
    negative_prompt: str,
    seed: int | None,
    width: int | None,
    height: int | None,
    num_inference_steps: int | None,
    guidance_scale: float | None,
    request_id: str | None,
    timeout: float | None,
    policy: RetryPolicy,
    /,
) -> GenerationCore:
    """The core of a `generate()` call, its arguments in the order of the public signature: the
    request (checked for what the wire cannot carry) and its deadline."""
    # Type errors are the caller's bug and fail here (TypeError); values out of the broker's bounds
    # are refused here too, with its message (kvrelay.limits, the one source of both), as
    # INVALID_ARGUMENT naming the field. Bounds of the deployment (prompt tokens, the largest
    # image a DiT draws) come back from the server.
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be str, not {type(prompt).__name__}")
    request = generation_pb2.GenerateRequest(
        request_id=wire_request_id(request_id) if request_id else "",
        prompt=wire_text("prompt", prompt),
        negative_prompt=wire_text("negative_prompt", negative_prompt or ""),
    )
    integers: tuple[tuple[str, int | None, Callable[[int], str | None]], ...] = (
        ("seed", seed, seed_problem),
        ("width", width, side_problem),
        ("height", height, side_problem),
        ("num_inference_steps", num_inference_steps, steps_problem),
    )
    for field, value, problem_of in integers:
        if value is None:
            continue
        number = wire_integer(field, value)
        checked(field, problem_of(number))
        setattr(request, field, number)
    if guidance_scale is not None:
        if not isinstance(guidance_scale, numbers.Real):
            # float("2") took a str as 2.0.
            raise TypeError(f"guidance_scale must be a number, not {type(guidance_scale).__name__} {guidance_scale!r}")
        checked("guidance_scale", guidance_problem(float(guidance_scale)))
        request.guidance_scale = float(guidance_scale)
    if request_id:
        # The broker keeps the generation this long after a broken stream, for the re-attach.
        request.detach_timeout_seconds = min(max(0.0, policy.reattach_seconds), MAX_DETACH_SECONDS)
    deadline = Deadline(checked_timeout(timeout) or DEFAULT_GENERATE_TIMEOUT)
    return GenerationCore(request, deadline, policy)


__all__ = [
    "NOTHING_TO_CANCEL",
    "AfterWait",
    "CancelPlan",
    "ClientBase",
    "ClientSettings",
    "Fail",
    "Finish",
    "GenerationCore",
    "HandleBase",
    "Reopen",
    "StreamEnd",
    "UnaryAttempts",
    "UnaryCall",
    "Wait",
    "cancel_generation",
    "get_generation",
    "get_pools",
    "get_replica_registry",
    "list_generations",
    "list_generations_page",
    "forget_replica",
    "list_replicas",
    "list_tickets",
    "new_generation",
    "raisable",
]
