"""What the sync and asyncio clients share: channel settings, deadlines, retry policy, requests.

Owns the rules both clients follow: every call has a deadline; only idempotent calls are retried,
and only on codes where the server cannot have acted (`UNAVAILABLE`); `Generate` is repeated only
to re-attach to a caller-supplied `request_id`. Never does I/O itself.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import grpc

from kvrelay.v1 import generation_pb2

from .errors import KvRelayError
from .types import ErrorStatus, GenerationEvent, GenerationResult, GenerationState, PhaseTimings

DEFAULT_TARGET = "127.0.0.1:50051"
# Big enough for a 2048x2048 RGB PNG of noise (~12 MiB) with room to spare.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Default deadline of unary calls (reads, cancel) when neither the call nor the client sets one.
DEFAULT_RPC_TIMEOUT = 30.0
# Default deadline of a whole generation; it travels with the request into Prefill and Denoise.
DEFAULT_GENERATE_TIMEOUT = 600.0
# Cancel is best effort on the way out (Ctrl-C): never hang the caller for long.
CANCEL_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of idempotent calls: exponential backoff with jitter, bounded by the deadline.

    Unary reads make at most `max_attempts` attempts. A `Generate` with a caller-chosen
    `request_id` keeps re-attaching for up to `reattach_seconds` without progress (long enough to
    ride out a replica or broker that `kvrelay up` is restarting), always within its deadline.
    """

    max_attempts: int = 4
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    reattach_seconds: float = 30.0

    def backoffs(self) -> Iterator[float]:
        """Delay before attempt 2, 3, ...: `max_attempts - 1` values."""
        delay = self.initial_backoff
        for _ in range(self.max_attempts - 1):
            yield min(self.max_backoff, delay) * random.uniform(0.8, 1.0)
            delay *= self.multiplier


class Reattach:
    """When to re-attach a Generate stream: backoff while no event arrives, within a window.

    The window applies once a kvrelay server has answered (an event, or an error carrying a
    server's reason such as NO_AR_REPLICA): then something is being restarted and is worth
    waiting for. A target that never answered (nothing listening) gets only `max_attempts`, so
    a typo or a node that is not up fails in about a second, not after the whole window.
    """

    def __init__(self, policy: RetryPolicy, deadline: Deadline) -> None:
        self._policy = policy
        self._deadline = deadline
        self._failing_since: float | None = None
        self._delay = policy.initial_backoff
        self._attempts = 1
        self._contacted = False

    def progressed(self) -> None:
        """An event arrived: the next failure starts a fresh window."""
        self._contacted = True
        self._failing_since = None
        self._delay = self._policy.initial_backoff

    def next_delay(self, error: KvRelayError) -> float | None:
        """Seconds to wait before re-attaching after `error`, or None to give up."""
        now = time.monotonic()
        self._contacted = self._contacted or error.reason != error.code
        if self._failing_since is None:
            self._failing_since = now
        self._attempts += 1
        if not self._contacted and self._attempts > self._policy.max_attempts:
            return None
        if now - self._failing_since >= self._policy.reattach_seconds:
            return None
        delay = min(self._policy.max_backoff, self._delay) * random.uniform(0.8, 1.0)
        self._delay *= self._policy.multiplier
        return delay if self._deadline.allows_sleep(delay) else None


def channel_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]


def channel_credentials(tls: bool, root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


class Deadline:
    """An absolute deadline on the monotonic clock; `None` seconds = no limit."""

    def __init__(self, seconds: float | None) -> None:
        self._at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        if self._at is None:
            return None
        return max(0.0, self._at - time.monotonic())

    def expired(self) -> bool:
        remaining = self.remaining()
        return remaining is not None and remaining <= 0.0

    def allows_sleep(self, seconds: float) -> bool:
        remaining = self.remaining()
        return remaining is None or remaining > seconds


def deadline_error(what: str, request_id: str | None = None) -> KvRelayError:
    return KvRelayError(
        "DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", f"{what}: deadline exceeded", request_id=request_id
    )


def build_generate_request(
    prompt: str,
    *,
    negative_prompt: str,
    seed: int | None,
    width: int | None,
    height: int | None,
    num_inference_steps: int | None,
    guidance_scale: float | None,
    request_id: str | None,
) -> generation_pb2.GenerateRequest:
    # Type errors are the caller's bug and fail here; value bounds are the server's to check
    # (one source of truth), and come back as INVALID_ARGUMENT naming the field.
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be str, not {type(prompt).__name__}")
    request = generation_pb2.GenerateRequest(
        request_id=request_id or "", prompt=prompt, negative_prompt=negative_prompt or ""
    )
    unsigned = (
        ("seed", seed, 64),
        ("width", width, 32),
        ("height", height, 32),
        ("num_inference_steps", num_inference_steps, 32),
    )
    for field, value, bits in unsigned:
        if value is None:
            continue
        # The wire type is unsigned: a value it cannot carry is refused here, like the server would.
        if not 0 <= int(value) < 1 << bits:
            raise KvRelayError(
                "INVALID_ARGUMENT",
                "INVALID_ARGUMENT",
                f"{field}: must be in [0, 2**{bits}), got {value}",
                {"field": field},
            )
        setattr(request, field, int(value))
    if guidance_scale is not None:
        request.guidance_scale = float(guidance_scale)
    return request


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


def stream_ended_error(request_id: str | None) -> KvRelayError:
    return KvRelayError(
        "UNAVAILABLE",
        "STREAM_ENDED",
        "the Generate stream ended before the generation finished",
        request_id=request_id,
    )


def enum_values(states: Iterable[IntEnum] | None) -> Any:
    """Public IntEnums as the proto's enum numbers (the values are the same by construction)."""
    return [int(s) for s in states or ()]
