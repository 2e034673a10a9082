"""Server-side errors: one exception type that maps to a gRPC status with google.rpc.ErrorInfo.

Handlers raise `KvRelayServerError(code, reason, message)`; `abort_with` turns it into a status
whose details carry a machine-readable reason, so SDK users get `code`, `reason`, `message`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2, timestamp_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "kvrelay.dev"
# Longest status message sent (the rest is cut, saying how much). The message travels twice in
# the trailers (grpc-message, percent-encoded, and inside grpc-status-details-bin, base64), and
# a peer refuses trailers over its metadata limit (gRPC: 8 KiB soft, 16 KiB hard): a message
# echoing a long input (a 100 kB `replica.endpoint`) reached the caller as RESOURCE_EXHAUSTED
# "received metadata size exceeds hard limit" instead of the error (found black-box).
MAX_ERROR_MESSAGE_CHARS = 1024


# The longest deadline a kvrelay process passes on to its own calls, in seconds (~31.7 years).
# gRPC keeps a call's deadline as int64 nanoseconds since the epoch: one past April 2262 (now +
# ~7.4e9 s) made the broker's Prefill call end DEADLINE_EXCEEDED at once, so a client whose
# deadline was that far (grpcurl -max-time 8e9, a Go client's "no deadline") saw every generation
# FAILED in PREFILLING (found black-box). Longer deadlines are held to this one.
MAX_DEADLINE_SECONDS = 1e9


def time_remaining(context: grpc.aio.ServicerContext) -> float | None:
    """The caller's time left (None: it set no deadline), at most MAX_DEADLINE_SECONDS: what a
    handler may pass on as the timeout of its own calls."""
    remaining = context.time_remaining()
    return None if remaining is None else min(remaining, MAX_DEADLINE_SECONDS)


def request_budget(
    context: grpc.aio.ServicerContext,
    default_s: float,
    deadline_time: timestamp_pb2.Timestamp | None,
    wall_clock: Callable[[], float] = time.time,
) -> float:
    """Seconds a stage request (Prefill, Denoise) may take: the caller's gRPC deadline, else
    `default_s` (the stage's request_timeout_seconds), and no later than the request's own
    `deadline_time`; never more than MAX_DEADLINE_SECONDS, however far or infinite the deadline
    asked (a replica passes this on to its own calls and waits). May be <= 0: already late."""
    remaining = context.time_remaining()
    budget = default_s if remaining is None else remaining
    if deadline_time is not None:
        # Read field by field: Timestamp.ToNanoseconds() raises ValueError outside the valid range
        # (a deadline_time the handler refuses afterwards with `timestamp_problem`).
        budget = min(budget, deadline_time.seconds + deadline_time.nanos / 1e9 - wall_clock())
    return min(budget, MAX_DEADLINE_SECONDS)


# google.protobuf.Timestamp's valid range: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999999Z.
MIN_TIMESTAMP_SECONDS = -62_135_596_800
MAX_TIMESTAMP_SECONDS = 253_402_300_799


def timestamp_problem(ts: timestamp_pb2.Timestamp) -> str | None:
    """Why `ts` is not a valid Timestamp, or None. Found black-box: a Prefill or Denoise whose
    deadline_time had seconds 2**62 or nanos -5 (a caller holding the replica token, posing as the
    broker) ended UNKNOWN with a ValueError traceback from Timestamp.ToNanoseconds()."""
    if not MIN_TIMESTAMP_SECONDS <= ts.seconds <= MAX_TIMESTAMP_SECONDS:
        return (f"seconds {ts.seconds} outside [{MIN_TIMESTAMP_SECONDS}, {MAX_TIMESTAMP_SECONDS}] "
                "(years 1 to 9999)")
    if not 0 <= ts.nanos <= 999_999_999:
        return f"nanos {ts.nanos} outside [0, 999999999]"
    return None


class KvRelayServerError(Exception):
    """An error to return to a gRPC caller: status code, UPPER_SNAKE reason, human message;
    `retry_delay_s`: when the caller may try again (google.rpc.RetryInfo), where the server knows."""

    def __init__(
        self, code: grpc.StatusCode, reason: str, message: str, *, retry_delay_s: float | None = None,
        **metadata: str,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.retry_delay_s = retry_delay_s
        self.metadata = {k: str(v) for k, v in metadata.items()}

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason}: {self.message}"


def invalid_argument(field: str, message: str) -> KvRelayServerError:
    return KvRelayServerError(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", f"{field}: {message}", field=field)


def not_found(what: str, ident: str) -> KvRelayServerError:
    return KvRelayServerError(grpc.StatusCode.NOT_FOUND, f"{what.upper()}_NOT_FOUND", f"unknown {what} {ident!r}")


def failed_precondition(reason: str, message: str) -> KvRelayServerError:
    return KvRelayServerError(grpc.StatusCode.FAILED_PRECONDITION, reason, message)


def bounded_message(message: str) -> str:
    """`message`, cut to MAX_ERROR_MESSAGE_CHARS characters with a note of what was cut."""
    if len(message) <= MAX_ERROR_MESSAGE_CHARS:
        return message
    cut = len(message) - MAX_ERROR_MESSAGE_CHARS
    return f"{message[:MAX_ERROR_MESSAGE_CHARS]}... ({cut} more characters)"


def broker_unreachable_line(broker: str, waited_s: float, code: str, message: str) -> str:
    """What an AR or DiT replica prints when the broker never answered its RegisterReplica: nothing
    was refused, so it says where it looked (one line, no traceback)."""
    return (
        f"the broker at {broker} did not answer RegisterReplica for {waited_s:g} s (last: {code}: {message}): "
        "is it running, and is --broker (or the config's broker.host and broker.port) right?"
    )


def to_status(err: KvRelayServerError) -> Any:
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=ERROR_DOMAIN, metadata=err.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    details = [detail]
    if err.retry_delay_s is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromNanoseconds(round(err.retry_delay_s * 1e9))
        details.append(any_pb2.Any())
        details[-1].Pack(retry)
    status = status_pb2.Status(code=err.code.value[0], message=bounded_message(err.message), details=details)
    return rpc_status.to_status(status)


async def abort_with(context: grpc.aio.ServicerContext, err: KvRelayServerError) -> NoReturn:
    """Abort the RPC with `err` as a rich status (code, message, ErrorInfo detail)."""
    await context.abort_with_status(to_status(err))
    raise AssertionError("unreachable: abort_with_status raises")


def reason_of(error: grpc.RpcError) -> tuple[str, str, str]:
    """(code name, reason, message) of an RpcError from another kvrelay service."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    reason = code.name if code is not None else "UNKNOWN"
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a transport error carries no trailing metadata
        status = None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
    return (code.name if code is not None else "UNKNOWN", reason, message or "")


__all__ = [
    "ERROR_DOMAIN",
    "KvRelayServerError",
    "MAX_ERROR_MESSAGE_CHARS",
    "abort_with",
    "bounded_message",
    "code_pb2",
    "failed_precondition",
    "invalid_argument",
    "not_found",
    "reason_of",
    "to_status",
]
