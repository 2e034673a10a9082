"""The SDK's one exception type, decoded from gRPC status + google.rpc.ErrorInfo.

Owns the translation of every failure a user can see (a status from the server, a transport
failure, a FAILED/CANCELLED generation) into `KvRelayError`. A raw `grpc.RpcError` must never
leave the SDK: every call site routes its errors through `error_from_rpc`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

# Codes whose RPCs may be retried when the call is idempotent: the server never acted, or the
# action is safe to repeat.
RETRYABLE_CODES = frozenset({"UNAVAILABLE"})


class KvRelayError(Exception):
    """Any failure reported by the kvrelay SDK.

    Attributes:
        code: gRPC status code name, e.g. ``"NOT_FOUND"``, ``"INVALID_ARGUMENT"``,
            ``"DEADLINE_EXCEEDED"``, ``"UNAVAILABLE"``, ``"CANCELLED"``.
        reason: machine-readable UPPER_SNAKE reason (``google.rpc.ErrorInfo.reason``), e.g.
            ``"GENERATION_NOT_FOUND"`` or ``"TRANSFER_TIMEOUT"``; the code name when the server
            sent none.
        message: human-readable text.
        details: ``ErrorInfo.metadata`` (e.g. ``{"field": "width"}``); empty when absent.
        request_id: the generation the error is about, when known.
    """

    def __init__(
        self,
        code: str,
        reason: str,
        message: str,
        details: Mapping[str, str] | None = None,
        *,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason or code
        self.message = message
        self.details: Mapping[str, str] = MappingProxyType(dict(details or {}))
        self.request_id = request_id

    @property
    def retryable(self) -> bool:
        """True when repeating an idempotent call may succeed (the server was unreachable)."""
        return self.code in RETRYABLE_CODES

    def __str__(self) -> str:
        head = f"{self.code} {self.reason}" if self.reason != self.code else self.code
        return f"{head}: {self.message}" if self.message else head

    def __repr__(self) -> str:
        return (
            f"KvRelayError(code={self.code!r}, reason={self.reason!r}, message={self.message!r}, "
            f"details={dict(self.details)!r}, request_id={self.request_id!r})"
        )

    def __reduce__(self) -> Any:
        return (_rebuild, (self.code, self.reason, self.message, dict(self.details), self.request_id))


def _rebuild(
    code: str, reason: str, message: str, details: dict[str, str], request_id: str | None
) -> KvRelayError:
    return KvRelayError(code, reason, message, details, request_id=request_id)


def error_from_rpc(error: grpc.RpcError, *, request_id: str | None = None) -> KvRelayError:
    """Decode a failed call (sync `grpc.Call` or `grpc.aio.AioRpcError`) into a KvRelayError."""
    code_obj = _call(error, "code")
    code = code_obj.name if isinstance(code_obj, grpc.StatusCode) else "UNKNOWN"
    message = _call(error, "details") or ""
    reason = code
    details: dict[str, str] = {}
    try:
        status = rpc_status.from_call(error)
    except (ValueError, TypeError, AttributeError):
        # Inconsistent or unparsable details (a proxy rewrote the status): keep the plain status.
        status = None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason or code
                details = dict(info.metadata)
                break
    return KvRelayError(code, reason, str(message), details, request_id=request_id)


def _call(error: grpc.RpcError, method: str) -> Any:
    fn = getattr(error, method, None)
    if fn is None:
        return None
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a half-initialised call object; treat as absent
        return None


__all__ = ["KvRelayError", "error_from_rpc"]
