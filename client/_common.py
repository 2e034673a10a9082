"""The SDK's settings and policies: defaults, channel options and credentials, deadlines, the
retry policy and the re-attach window. `_core` applies them; never does I/O itself.

The rules: every call has a deadline; only idempotent calls are retried, and only on codes where
the server cannot have acted (`UNAVAILABLE`); `Generate` is repeated only to re-attach to a
caller-supplied `request_id`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from .errors import KvRelayError

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_PORT = 50051
# Big enough for a 2048x2048 RGB PNG of noise (~12 MiB) with room to spare.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Default deadline of unary calls (reads, cancel) when neither the call nor the client sets one.
DEFAULT_RPC_TIMEOUT = 30.0
# Default deadline of a whole generation; it travels with the request into Prefill and Denoise.
DEFAULT_GENERATE_TIMEOUT = 600.0
# Cancel is best effort on the way out (Ctrl-C): never hang the caller for long.
CANCEL_TIMEOUT = 5.0
# HTTP/2 keepalive while a call is open (a status stream may wait minutes for its next event):
# a connection that stops answering pings ends its calls UNAVAILABLE within time + timeout, and
# a Generate with a request_id re-attaches. The broker accepts pings every 5 s or less.
KEEPALIVE_TIME = 15.0
KEEPALIVE_TIMEOUT = 15.0

# A monotonic clock in seconds (time.monotonic; tests pass a fake one).
Clock = Callable[[], float]


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

    def __post_init__(self) -> None:
        # Refused here, at construction, with the field's name: a NaN or negative backoff used to
        # surface mid-retry as `ValueError: sleep length must be non-negative` (or never end).
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise TypeError(f"RetryPolicy.max_attempts must be an int, got {type(self.max_attempts).__name__}")
        if not 1 <= self.max_attempts <= 100:
            raise ValueError(f"RetryPolicy.max_attempts must be in [1, 100], got {self.max_attempts}")
        for name, low, high in (
            ("initial_backoff", 0.0, 3600.0),
            ("max_backoff", 0.0, 3600.0),
            ("multiplier", 1.0, 100.0),
            ("reattach_seconds", 0.0, 86400.0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"RetryPolicy.{name} must be a number, got {type(value).__name__}")
            if not low <= value <= high:  # also refuses NaN
                raise ValueError(f"RetryPolicy.{name} must be in [{low:g}, {high:g}], got {value!r}")
        if self.max_backoff < self.initial_backoff:
            raise ValueError(
                f"RetryPolicy.max_backoff ({self.max_backoff!r}) must be >= initial_backoff ({self.initial_backoff!r})"
            )

    def backoffs(self, rng: random.Random | None = None) -> Iterator[float]:
        """Delay before attempt 2, 3, ...: `max_attempts - 1` values."""
        uniform = (rng or random).uniform
        delay = self.initial_backoff
        for _ in range(self.max_attempts - 1):
            yield min(self.max_backoff, delay) * uniform(0.8, 1.0)
            delay *= self.multiplier


class Reattach:
    """When to re-attach a Generate stream: backoff while no event arrives, within a window.

    The window applies once a kvrelay server has answered (an event, or an error carrying a
    server's reason such as NO_AR_REPLICA): then something is being restarted and is worth
    waiting for. A target that never answered (nothing listening) gets only `max_attempts`, so
    a typo or a node that is not up fails in about a second, not after the whole window.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        deadline: Deadline,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._policy = policy
        self._deadline = deadline
        self._clock = clock or time.monotonic
        self._uniform = (rng or random).uniform
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
        now = self._clock()
        self._contacted = self._contacted or error.reason != error.code
        if self._failing_since is None:
            self._failing_since = now
        self._attempts += 1
        if not self._contacted and self._attempts > self._policy.max_attempts:
            return None
        if now - self._failing_since >= self._policy.reattach_seconds:
            return None
        delay = min(self._policy.max_backoff, self._delay) * self._uniform(0.8, 1.0)
        self._delay *= self._policy.multiplier
        return delay if self._deadline.allows_sleep(delay) else None


_OTHER_SCHEMES = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def normalize_target(target: str, default_port: int = DEFAULT_PORT) -> str:
    """`target` with the broker's default port filled in where it names none.

    gRPC resolves a target without a port to port 443, so `localhost` would silently dial the
    wrong service. `host`, `[v6]`, a bare IPv6 address and `dns:` targets get `default_port`;
    `host:port` and other schemes (`unix:`, `ipv4:`...) are kept as given.
    """
    if not isinstance(target, str):
        raise TypeError(f"target must be str, not {type(target).__name__} {target!r}")
    target = target.strip()
    if not target:
        return DEFAULT_TARGET
    if target.startswith("dns:"):
        rest = target[len("dns:") :]
        prefix = "dns:"
        if rest.startswith("//"):
            slash = rest.find("/", 2)
            if slash < 0:
                return target
            prefix, rest = prefix + rest[: slash + 1], rest[slash + 1 :]
        return prefix + normalize_target(rest, default_port)
    if target.startswith(_OTHER_SCHEMES):
        return target
    if "://" in target:
        # `--target http://127.0.0.1:50051` (the metrics URLs `kvrelay up` prints look so) was
        # dialed as the IPv6 host "[http://127.0.0.1:50051]:50051" and failed DNS resolution.
        scheme, _, rest = target.partition("://")
        raise KvRelayError(
            "INVALID_ARGUMENT",
            "INVALID_ARGUMENT",
            f"target: {target!r} is a URL; a kvrelay target is HOST:PORT (here {rest.rstrip('/')!r}; "
            f"{scheme}:// is not a gRPC scheme, TLS is the tls= / --tls-ca setting)",
            {"field": "target"},
        )
    if target.startswith("["):
        return target if "]:" in target else f"{target}:{default_port}"
    if target.count(":") > 1:
        return f"[{target}]:{default_port}"  # a bare IPv6 address
    host, sep, port = target.partition(":")
    if not sep:
        return f"{target}:{default_port}"
    if not port:
        return f"{host}:{default_port}"
    return target  # host:port, or another scheme (unix:, ipv4:, vsock:...) said in full


def channel_options(
    keepalive_time: float | None = KEEPALIVE_TIME, keepalive_timeout: float = KEEPALIVE_TIMEOUT
) -> list[tuple[str, Any]]:
    """Message size limits, and keepalive unless `keepalive_time` is None."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    if keepalive_time is not None:
        if not (keepalive_time > 0 and keepalive_timeout > 0):
            raise ValueError(f"keepalive_time and keepalive_timeout must be positive, got "
                             f"{keepalive_time}, {keepalive_timeout}")
        options += [
            ("grpc.keepalive_time_ms", max(1, round(keepalive_time * 1000))),
            ("grpc.keepalive_timeout_ms", max(1, round(keepalive_timeout * 1000))),
            # The timeout gRPC applies to an unanswered ping (default 1 minute): without it, the
            # keepalive timeout is forgotten as soon as any byte arrives from the peer.
            ("grpc.http2.ping_timeout_ms", max(1, round(keepalive_timeout * 1000))),
            # Pings only while a call is open: an idle client never pings a proxy that forbids it.
            ("grpc.keepalive_permit_without_calls", 0),
            # gRPC's default (2) stops pinging an idle stream after two pings.
            ("grpc.http2.max_pings_without_data", 0),
        ]
    return options


def channel_credentials(
    tls: bool,
    root_certificates: bytes | None,
    certificate_chain: bytes | None = None,
    private_key: bytes | None = None,
) -> grpc.ChannelCredentials | None:
    if (certificate_chain is None) != (private_key is None):
        raise ValueError("certificate_chain and private_key go together (mutual TLS)")
    if not tls and root_certificates is None and certificate_chain is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=root_certificates, private_key=private_key, certificate_chain=certificate_chain
    )


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The `authorization` metadata of a bearer token. Surrounding whitespace is dropped, as the
    servers drop it from their own token files and variables (a token read from a file keeps its
    newline); a token that still is not printable ASCII is INVALID_ARGUMENT naming `token`: gRPC
    raised ValueError "metadata was invalid" from every call, a traceback in the CLI (found
    black-box with KVRELAY_API_TOKEN=$'abc\\n' and a non-ASCII token)."""
    if token is not None and not isinstance(token, str):
        raise TypeError(f"token must be str or None, not {type(token).__name__} {token!r}")
    token = token.strip() if token else token
    if not token:
        return None
    for at, char in enumerate(token):
        if not " " <= char <= "~":
            raise KvRelayError(
                "INVALID_ARGUMENT",
                "INVALID_ARGUMENT",
                f"token: {ascii(char)} at character {at} is not printable ASCII, which a bearer token is",
                {"field": "token"},
            )
    return (("authorization", f"Bearer {token}"),)


class Deadline:
    """An absolute deadline on the monotonic clock; `None` seconds = no limit."""

    def __init__(self, seconds: float | None, clock: Clock | None = None) -> None:
        self._clock = clock or time.monotonic
        self._at = None if seconds is None else self._clock() + seconds

    def remaining(self) -> float | None:
        if self._at is None:
            return None
        return max(0.0, self._at - self._clock())

    def expired(self) -> bool:
        remaining = self.remaining()
        return remaining is not None and remaining <= 0.0

    def allows_sleep(self, seconds: float) -> bool:
        remaining = self.remaining()
        return remaining is None or remaining > seconds
