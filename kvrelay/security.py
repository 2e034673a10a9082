"""Credentials of kvrelay's control plane: every channel, every server, one interceptor.

Owns what a process presents (bearer token, replica id, client certificate) and what a server
accepts: `make_channel` / `make_sync_channel` are the only way kvrelay code opens a gRPC channel,
`server_credentials` / `server_options` the only way a server listens, and `AuthInterceptor`
(one instance per server, shared by every service on it) gives each RPC its caller class from
`RPC_RULES`, checks the credential in constant time, rate-limits (per verified identity, else per
peer host), bounds id fields and runs the per-RPC ownership checks a service registers. An RPC missing from `RPC_RULES` is refused.

It must never hold business logic: "is this ticket yours" lives with the broker (broker/authz.py),
which hands its checks to the interceptor.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import enum
import hashlib
import hmac
import inspect
import ipaddress
import math
import os
import resource
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kvrelay.errors import KvRelayServerError, abort_with
from kvrelay.limits import (
    LIST_GENERATIONS_PER_REQUEST,
    LIST_REPLY_BYTES_PER_REQUEST,
    MAX_PEM_FILE_BYTES,
    MAX_REQUEST_ID_LENGTH,
    MAX_SECRET_FILE_BYTES,
    FileRefused,
    list_page_size,
    read_bounded_file,
    request_id_problem,
)
from kvrelay.logging import get_logger

log = get_logger(__name__)

if TYPE_CHECKING:
    from kvrelay.config import SecurityConfig

# Replies may carry a 2048x2048 PNG (~12 MiB worst case); requests are small except PutKv chunks
# (<= 1 MiB each). Both limits are set explicitly on every channel and server.
MAX_REPLY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
# How long calls still running on a channel dropped by `ChannelCache.forget` may go on: a
# failed connection rarely leaves a healthy call behind, but a long Denoise stream may be one.
FORGOTTEN_CHANNEL_GRACE_S = 600.0
# Longest id (replica, ticket, incarnation) any RPC accepts. A request_id has its own, shorter
# bound: kvrelay.limits.MAX_REQUEST_ID_LENGTH (128), the one every generation id is held to.
MAX_ID_CHARS = 256
# Streams of the RPCs open to anyone (health Watch, reflection) one server holds at once; one
# more is RESOURCE_EXHAUSTED TOO_MANY_STREAMS. Each held ~25 KB of the server for as long as the
# peer kept it: 10000 anonymous Watch streams grew the broker by 256 MB, with no bound.
MAX_OPEN_STREAMS = 256
# A replica RPC refused for its credential is logged (`replica_credential_refused`) once per
# declared replica id per REFUSAL_LOG_S, at most MAX_REFUSAL_LOGS_PER_WINDOW lines in that time;
# a server keeps a record of at most MAX_REFUSAL_LOG_IDS refused ids (kvrelay status shows the
# broker's).
REFUSAL_LOG_S = 60.0
MAX_REFUSAL_LOG_IDS = 256
MAX_REFUSAL_LOGS_PER_WINDOW = 32
# Listeners accept a client's pings every min(keepalive time / 2, this) seconds: pings more often,
# with no data to send, are "bad pings", and after two gRPC sends GOAWAY too_many_pings. Half the
# interval for timer jitter; 5 s at most, so an SDK client on its defaults (15 s) is never cut
# off by a broker configured for longer pings.
PINGS_ALLOWED_EVERY_S = 5.0
# security.rotation_grace_seconds' default: how long a server still takes credentials a reload
# replaced (CredentialRotation).
DEFAULT_ROTATION_GRACE_S = 300.0
# Replica ids a CredentialRotation remembers as holding the new credentials during a grace
# period (any authenticated caller may declare ids in shared mode: bounded).
MAX_ROTATION_IDS = 4096
# Replaced credential generations a CredentialRotation still takes, each until its own grace
# ends: a rotation past this many within the grace drops the oldest at once (logged).
MAX_SUPERSEDED_GENERATIONS = 3

# Rate-limit buckets one server keeps, for identities and for peer hosts each (_RateLimiter):
# identities come from verified credentials only (a bound replica token, a certificate), so
# nobody mints them; hosts are bounded for callers that authenticate without one.
MAX_RATE_BUCKETS = 4096

AUTHORIZATION_METADATA = "authorization"
REPLICA_ID_METADATA = "kvrelay-replica-id"
# The id the broker's orchestrator declares when it calls AR and DiT replicas.
BROKER_CALLER_ID = "broker"


class CallerClass(enum.StrEnum):
    """Who may call an RPC (DESIGN.md section 11)."""

    PUBLIC = "public"  # anyone; the api token when the deployment sets one
    REPLICA = "replica"  # AR/DiT <-> broker: the replica token or a client certificate
    OPERATOR = "operator"  # status, cancel any, deregister any, debug: the operator token


@dataclass(frozen=True, slots=True)
class RpcRule:
    caller_class: CallerClass
    # Operators may call it too (on anything), e.g. DeregisterReplica, CancelTicket.
    operator_too: bool
    # What the server checks beyond the credential, for docs/operations.md.
    checks: str
    # Public RPCs that need no credential even when the api token is set (health, reflection).
    always_open: bool = False
    # What one call counts for against its caller's rate-limit bucket (security.rate_limit_per_
    # second), from its request; None: 1, and a public RPC is not rate-limited at all. A call
    # whose cost grows with what it asks for (a ListGenerations page) counts for that cost.
    cost: Callable[[Any], float] | None = None
    # What its reply counts for on top, from the reply a unary handler returned: taken from the
    # same bucket once the work is done, as debt when the bucket holds less (the caller's next
    # call waits until it is paid). A reply whose size the request cannot tell (a ListGenerations
    # page of retained prompts) counts for what it carried.
    reply_cost: Callable[[Any], float] | None = None


def list_generations_cost(request: Any) -> float:
    """ListGenerations counts as one request plus one per LIST_GENERATIONS_PER_REQUEST
    generations its page may hold (the default page of 100: 11; 1000: 101). Found black-box: a
    client within its rate limit flooding ListGenerations took the broker's event loop (a health
    check took 4.9 s); each listed generation costs the loop a few microseconds."""
    return 1.0 + list_page_size(int(getattr(request, "page_size", 0))) / LIST_GENERATIONS_PER_REQUEST


def list_generations_reply_cost(reply: Any) -> float:
    """ListGenerations' reply counts one more request per LIST_REPLY_BYTES_PER_REQUEST bytes it
    carries (a 4 MiB page of an operator's retained prompts: 1024). Found with
    benchmarks/list_flood.py: an operator's flood, within the page count, held a Heartbeat
    240-450 ms at p99 (each 4 MiB reply holds the loop ~10-20 ms)."""
    return float(reply.ByteSize()) / LIST_REPLY_BYTES_PER_REQUEST


_B = "/kvrelay.v1.BrokerService/"
_G = "/kvrelay.v1.GenerationService/"
_A = "/kvrelay.v1.ArService/"
_D = "/kvrelay.v1.DitService/"
_OWN_TICKET = "the ticket's AR or DiT replica is the caller"
RPC_RULES: Mapping[str, RpcRule] = {
    # -- public --------------------------------------------------------------------------------
    _G + "Generate": RpcRule(CallerClass.PUBLIC, True, "input bounds (prompt, size, steps, guidance)"),
    _G + "GetGeneration": RpcRule(CallerClass.PUBLIC, True, "request_id (the id is the capability)"),
    _G + "CancelGeneration": RpcRule(CallerClass.PUBLIC, True, "request_id (the id is the capability)"),
    # Public (DESIGN: GenerationService is public), but a request_id is the capability of Get/
    # CancelGeneration: a caller that is not an operator gets every generation without its
    # request_id, ticket_id and prompts (broker/generation.py redacts them).
    _G + "ListGenerations": RpcRule(
        CallerClass.PUBLIC, True,
        "states, page_token; no images; ids, prompts and error messages only for an operator; rate-limited "
        f"as 1 + page_size/{LIST_GENERATIONS_PER_REQUEST} requests, then 1 per {LIST_REPLY_BYTES_PER_REQUEST} "
        "bytes of its reply",
        cost=list_generations_cost,
        reply_cost=list_generations_reply_cost,
    ),
    "/grpc.health.v1.Health/Check": RpcRule(CallerClass.PUBLIC, True, "none", always_open=True),
    "/grpc.health.v1.Health/Watch": RpcRule(CallerClass.PUBLIC, True, "none", always_open=True),
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": RpcRule(
        CallerClass.PUBLIC, True, "none", always_open=True
    ),
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": RpcRule(
        CallerClass.PUBLIC, True, "none", always_open=True
    ),
    # -- replica -> broker ---------------------------------------------------------------------
    _B + "RegisterReplica": RpcRule(CallerClass.REPLICA, False, "replica.replica_id is the caller"),
    _B + "Heartbeat": RpcRule(CallerClass.REPLICA, False, "replica_id is the caller"),
    _B + "DeregisterReplica": RpcRule(CallerClass.REPLICA, True, "replica_id is the caller (operator: any)"),
    _B + "ReserveTicket": RpcRule(
        CallerClass.REPLICA, False, "ar_replica_id is the caller and the ticket's AR replica"
    ),
    _B + "ReportWrite": RpcRule(CallerClass.REPLICA, False, "replica_id is the caller and the ticket's AR replica"),
    _B + "ReportLoad": RpcRule(CallerClass.REPLICA, False, "replica_id is the caller and the ticket's DiT replica"),
    _B + "ReleaseTicket": RpcRule(
        CallerClass.REPLICA, False, "replica_id (required) is the caller and the ticket's DiT replica"
    ),
    _B + "StartConsuming": RpcRule(
        CallerClass.REPLICA, False, "replica_id (required) is the caller and the ticket's DiT replica"
    ),
    _B + "CancelTicket": RpcRule(CallerClass.REPLICA, True, _OWN_TICKET + " (operator: any)"),
    _B + "GetTicket": RpcRule(CallerClass.REPLICA, True, _OWN_TICKET + " (operator: any)"),
    _B + "WatchTicket": RpcRule(CallerClass.REPLICA, True, _OWN_TICKET + " (operator: any)"),
    # -- operator ------------------------------------------------------------------------------
    _B + "CreateTicket": RpcRule(
        CallerClass.OPERATOR, True, "debug only; ends TIMED_OUT after the stages' request_timeout_seconds"
    ),
    _B + "ListTickets": RpcRule(CallerClass.OPERATOR, True, "none"),
    _B + "GetPool": RpcRule(CallerClass.OPERATOR, True, "none"),
    _B + "ListReplicas": RpcRule(CallerClass.OPERATOR, True, "none"),
    _B + "ForgetReplica": RpcRule(
        CallerClass.OPERATOR, True, "an operator (development: an undeclared caller); only a replica safe to forget"
    ),
    _B + "ReloadCredentials": RpcRule(
        CallerClass.OPERATOR, True, "an operator (development: an undeclared caller)"
    ),
    # -- broker -> replicas, AR -> DiT ---------------------------------------------------------
    _A + "Tokenize": RpcRule(CallerClass.REPLICA, False, "caller is the broker"),
    _A + "Prefill": RpcRule(CallerClass.REPLICA, False, "caller is the broker"),
    _D + "Denoise": RpcRule(CallerClass.REPLICA, False, "caller is the broker"),
    _D + "PutKv": RpcRule(CallerClass.REPLICA, False, "caller is the ticket's AR replica; writes land only in armed tickets"),
}


class SecurityError(ValueError):
    """A security setting kvrelay refuses to start with; the message names the key or flag."""


@dataclass(frozen=True, slots=True)
class Keepalive:
    """HTTP/2 keepalive of every kvrelay channel and listener (`security.keepalive_*_seconds`).

    Without it a connection that silently stopped carrying packets (a host gone, a one-way
    partition, a peer stopped with SIGSTOP) was never noticed: a call on it waited for its
    deadline, a stream without one forever. With it, each side pings every `time_s` and closes
    the connection when a ping has no ack within `timeout_s`: its calls end UNAVAILABLE within
    `time_s + timeout_s`. A closed connection is only "I stopped waiting":
    it never counts as proof that the peer's work is over (DESIGN.md section 6).
    """

    time_s: float = 15.0
    timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if not (self.time_s > 0 and self.timeout_s > 0):
            raise SecurityError(f"keepalive: time and timeout must be positive, got {self.time_s}, {self.timeout_s}")

    @property
    def detect_within_s(self) -> float:
        """The longest a call on a dead connection outlives it."""
        return self.time_s + self.timeout_s

    def channel_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.keepalive_time_ms", _ms(self.time_s)),
            ("grpc.keepalive_timeout_ms", _ms(self.timeout_s)),
            # What really bounds an unanswered ping (default 1 minute): gRPC drops the keepalive
            # timeout as soon as any byte arrives, and a one-way partition still delivers bytes.
            ("grpc.http2.ping_timeout_ms", _ms(self.timeout_s)),
            # Idle connections too: a dead one is found before a call is sent into it.
            ("grpc.keepalive_permit_without_calls", 1),
            # gRPC's default (2) stops pinging after two pings without data: a long idle stream
            # (a status watch, a Denoise waiting for its KV) would be unguarded after 2 x time_s.
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def server_options(self) -> list[tuple[str, Any]]:
        return [
            # The server pings its clients too: a handler whose caller vanished (a Denoise of a
            # broker cut off) is cancelled, and its `finally` hands back what it holds.
            *self.channel_options(),
            # ... and lets clients ping this often, with or without calls (gRPC's default is
            # every 5 minutes, no calls: our own channels would be sent GOAWAY too_many_pings).
            ("grpc.http2.min_ping_interval_without_data_ms", _ms(min(self.time_s / 2, PINGS_ALLOWED_EVERY_S))),
        ]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


DEFAULT_KEEPALIVE = Keepalive()


# ---------------------------------------------------------------- bound replica tokens
#
# `security.replica_tokens: bound` (docs/operations.md, Per-replica tokens). Every value is an
# HMAC-SHA256 in hex, each of a distinct label, so that no value doubles as another:
#   replica token of R     = HMAC(secret, "replica-token" | R)   held by R; the broker derives it
#   broker's call token    = HMAC(replica token of R, "broker-call")      the broker -> R
#   write token of A at D  = HMAC(replica token of D, "put-kv" | A)       A -> D's PutKv
# A replica can check what is presented to it from its own token alone, and what it receives
# works nowhere else: R's call token opens R only, a write token only PutKv of D as A.

_TOKEN_LABEL = b"kvrelay.v1."


def _mac(key: str, label: str, subject: str = "") -> str:
    message = _TOKEN_LABEL + label.encode() + b"\x00" + subject.encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def replica_token_for(secret: str, replica_id: str) -> str:
    """The token of `replica_id` under the broker's secret (`kvrelay token REPLICA_ID`)."""
    if not secret:
        raise SecurityError("a bound replica token needs the broker's secret (security.replica_secret_env/_file)")
    if not replica_id or replica_id == BROKER_CALLER_ID:
        raise SecurityError(f"no replica token for {replica_id!r}: name a replica (ar-0, dit-1)")
    return _mac(secret, "replica-token", replica_id)


def broker_call_token(replica_token: str) -> str:
    """What the broker presents when it calls the replica whose token this is."""
    return _mac(replica_token, "broker-call")


def put_kv_token(dit_replica_token: str, ar_replica_id: str) -> str:
    """What `ar_replica_id` presents on PutKv to the DiT replica whose token this is."""
    return _mac(dit_replica_token, "put-kv", ar_replica_id)


def _same(presented: str, expected: str | None) -> bool:
    return bool(expected) and hmac.compare_digest(presented.encode(), expected.encode())  # type: ignore[union-attr]


# ---------------------------------------------------------------- credentials of a process


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    # None on a client that only verifies the server (no client certificate).
    cert_chain: bytes | None
    private_key: bytes | None
    root_certificates: bytes
    require_client_cert: bool = False
    server_name: str | None = None
    operator_names: tuple[str, ...] = ("kvrelay-operator",)
    replica_names: tuple[str, ...] = ("kvrelay-node",)


@dataclass(frozen=True, slots=True)
class Credentials:
    """Everything one process knows: the deployment's tokens and its TLS material."""

    api_token: str | None = None
    # Shared mode: the deployment's replica token. Bound mode: this replica's own token
    # (`replica_token_for(secret, its id)`); the broker holds none.
    replica_token: str | None = None
    operator_token: str | None = None
    tls: TlsMaterial | None = None
    # `security.replica_tokens: bound`: a replica token is valid only for the id it was derived
    # for; the broker holds the secret they derive from (`replica_secret`), replicas none.
    bound_replica_tokens: bool = False
    replica_secret: str | None = field(default=None, repr=False)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    rate_limit_per_second: float = 0.0
    rate_limit_burst: int = 1
    keepalive: Keepalive = DEFAULT_KEEPALIVE
    # How long credentials a reload replaced are still taken (security.rotation_grace_seconds).
    rotation_grace_s: float = DEFAULT_ROTATION_GRACE_S

    @property
    def authenticates_replicas(self) -> bool:
        """False = a development deployment: replica and operator RPCs trust every caller."""
        return (
            self.bound_replica_tokens or bool(self.replica_token) or bool(self.tls and self.tls.require_client_cert)
        )

    def channel(self, caller_class: CallerClass, replica_id: str | None = None) -> ChannelSecurity:
        """How this process dials as `caller_class` (and, for a replica, as `replica_id`)."""
        token = {
            CallerClass.PUBLIC: self.api_token,
            CallerClass.REPLICA: self.replica_token,
            CallerClass.OPERATOR: self.operator_token,
        }[caller_class]
        return ChannelSecurity(token=token, replica_id=replica_id, tls=self.tls, keepalive=self.keepalive)

    def put_kv_channel(self, replica_id: str | None) -> ChannelSecurity:
        """How an AR replica's ranks dial DiT replicas' PutKv: the replica id alone, in every mode;
        each call carries its bearer (`put_kv_bearer`: bound mode, the write token the broker gave
        for that DiT, as its own token would let the DiT act as this AR at the broker; shared mode,
        the replica token the AR holds when it sends the command). The ranks are other processes:
        a token kept in their channel would outlive a reload of the AR's token file
        (kvrelay.replica_token), half the replica presenting the new token and half the old."""
        return ChannelSecurity(token=None, replica_id=replica_id, tls=self.tls, keepalive=self.keepalive)

    def put_kv_bearer(self, write_token: str) -> str:
        """The bearer of one PutKv command of this AR: the broker's `write_token` in bound mode
        ("" when it gave none: this AR's own token never goes to a DiT there), else the shared
        replica token: the one the broker gave (during a rotation's grace, the one the DiT
        holds, kvrelay.security.CredentialRotation.write_token), else this AR's own (or "" in a
        development deployment)."""
        if self.bound_replica_tokens:
            return write_token
        return write_token or self.replica_token or ""

    def broker_channel(self, replica_id: str | None) -> ChannelSecurity:
        """How the broker dials the replica `replica_id` (Tokenize, Prefill, Denoise). Bound
        mode: with the call token of that replica alone (`broker_call_token`), which no other
        replica can present, nor learn from the calls it receives itself."""
        sec = self.channel(CallerClass.REPLICA, BROKER_CALLER_ID)
        if not self.bound_replica_tokens:
            return sec
        token = None
        if self.replica_secret and replica_id:
            token = broker_call_token(replica_token_for(self.replica_secret, replica_id))
        return ChannelSecurity(token=token, replica_id=BROKER_CALLER_ID, tls=self.tls, keepalive=self.keepalive)

    def write_token(self, dit_replica_id: str, ar_replica_id: str) -> str:
        """What the broker hands `ar_replica_id` (PrefillRequest.write_token) to write the KV of
        its ticket into `dit_replica_id` over PutKv; "" unless bound mode."""
        if not (self.bound_replica_tokens and self.replica_secret):
            return ""
        return put_kv_token(replica_token_for(self.replica_secret, dit_replica_id), ar_replica_id)

    def client_options(self, caller_class: CallerClass = CallerClass.PUBLIC) -> dict[str, Any]:
        """Keyword arguments for kvrelay.client.KvRelayClient / AsyncKvRelayClient."""
        sec = self.channel(caller_class)
        options: dict[str, Any] = {
            "token": sec.token,
            "keepalive_time": self.keepalive.time_s,
            "keepalive_timeout": self.keepalive.timeout_s,
        }
        if self.tls is not None:
            options.update(
                tls=True,
                root_certificates=self.tls.root_certificates,
                certificate_chain=self.tls.cert_chain,
                private_key=self.tls.private_key,
            )
        return options


def _read_secret(env: str | None, file: str | None, key: str) -> str | None:
    if file:
        what = "file holding the secret" if key == "replica_secret" else "file holding the token"
        try:
            value = read_bounded_file(file, MAX_SECRET_FILE_BYTES, what).decode().strip()
        except FileRefused as err:
            raise SecurityError(f"security.{key}_file: {file}: {err}") from None
        except OSError as err:
            raise SecurityError(f"security.{key}_file: cannot read {file}: {err.strerror}") from None
        except UnicodeDecodeError:
            raise SecurityError(f"security.{key}_file: {file} is not UTF-8 text") from None
        if not value:
            raise SecurityError(f"security.{key}_file: {file} is empty")
        return _usable_secret(value, key, f"security.{key}_file ({file})")
    if env:
        return _usable_secret(os.environ.get(env, "").strip(), key, f"security.{key}_env (${env})") or None
    return None


def _usable_secret(value: str, key: str, where: str) -> str:
    """`value` if every server can compare it: a token travels in an `authorization` header, so it
    is printable ASCII; the secret is HMAC key bytes, so it is text that encodes as UTF-8. Found
    black-box: $KVRELAY_OPERATOR_TOKEN holding a byte 0xff (an environment's undecodable bytes
    come as lone surrogates) let the broker start SERVING and then answer every authenticated
    RPC, Generate included, UNKNOWN with a UnicodeEncodeError traceback. Names no character."""
    if key == "replica_secret":
        try:
            value.encode()
        except UnicodeEncodeError:
            raise SecurityError(f"{where}: the secret is not text (bytes that are not UTF-8); make one with "
                                "`python -c 'import secrets; print(secrets.token_hex(32))'`") from None
    elif not all(" " <= c <= "~" for c in value):
        raise SecurityError(f"{where}: a token is printable ASCII (it travels in an authorization header); "
                            "this one is not")
    return value


def _read_pem(path: str, where: str) -> bytes:
    """A PEM file named by `where` (the config key, or the client flag)."""
    try:
        data = read_bounded_file(path, MAX_PEM_FILE_BYTES, "PEM file")
    except FileRefused as err:
        raise SecurityError(f"{where}: {path}: {err}") from None
    except OSError as err:
        raise SecurityError(f"{where}: cannot read {path}: {err.strerror}") from None
    if b"-----BEGIN" not in data:
        raise SecurityError(f"{where}: {path} is not PEM")
    return data


def client_tls_from_files(ca: str | None, cert: str | None = None, key: str | None = None) -> TlsMaterial | None:
    """TLS of a command-line client (`--tls-ca`, `--tls-cert`, `--tls-key`); None without a CA."""
    if not ca:
        if cert or key:
            raise SecurityError("--tls-cert/--tls-key need --tls-ca (the roots that sign the server)")
        return None
    if bool(cert) != bool(key):
        raise SecurityError("--tls-cert and --tls-key go together (mutual TLS)")
    return TlsMaterial(
        cert_chain=_read_pem(cert, "--tls-cert") if cert else None,
        private_key=_read_pem(key, "--tls-key") if key else None,
        root_certificates=_read_pem(ca, "--tls-ca"),
    )


def tls_files(cfg: SecurityConfig, name: str = BROKER_CALLER_ID) -> str:
    """Where the process `name` reads its TLS material from, in words ("" without TLS)."""
    if cfg.tls is None:
        return ""
    return (f"security.tls.cert_file ({cfg.tls.cert_file.replace('{name}', name)}), security.tls.key_file "
            f"({cfg.tls.key_file.replace('{name}', name)}), security.tls.ca_file ({cfg.tls.ca_file})")  # fmt: skip


def read_tls(cfg: SecurityConfig, name: str = BROKER_CALLER_ID) -> TlsMaterial | None:
    """The TLS material of the process `name` (`{name}` in `cert_file` / `key_file`), each PEM
    file read once, bounded; None without `security.tls`. At start, and again by `kvrelay
    rotate-secrets` (the broker checks a pair before serving it: kvrelay.server_tls)."""
    if cfg.tls is None:
        return None
    return TlsMaterial(
        cert_chain=_read_pem(cfg.tls.cert_file.replace("{name}", name), "security.tls.cert_file"),
        private_key=_read_pem(cfg.tls.key_file.replace("{name}", name), "security.tls.key_file"),
        root_certificates=_read_pem(cfg.tls.ca_file, "security.tls.ca_file"),
        require_client_cert=cfg.tls.require_client_cert,
        server_name=cfg.tls.server_name,
        operator_names=tuple(cfg.tls.operator_names),
        replica_names=tuple(cfg.tls.replica_names),
    )


def load_credentials(cfg: SecurityConfig, name: str = BROKER_CALLER_ID) -> Credentials:
    """Resolve the `security:` section for the process `name` (`broker`, `ar-0`, `dit-1`): tokens
    from env vars or files, PEM files read once. `{name}` in `tls.cert_file` / `tls.key_file`
    gives each process its own certificate (common name = its id: mutual TLS then binds it)."""
    tls = read_tls(cfg, name)
    creds = Credentials(
        bound_replica_tokens=cfg.replica_tokens == "bound",
        tls=tls,
        max_request_bytes=cfg.max_receive_message_bytes,
        rate_limit_per_second=cfg.rate_limit_per_second,
        rate_limit_burst=cfg.rate_limit_burst,
        keepalive=Keepalive(cfg.keepalive_time_seconds, cfg.keepalive_timeout_seconds),
        rotation_grace_s=cfg.rotation_grace_seconds,
    )
    return reload_tokens(cfg, creds, name)


def reload_tokens(cfg: SecurityConfig, creds: Credentials, name: str = BROKER_CALLER_ID) -> Credentials:
    """`creds` with the tokens (and the broker's secret) of the process `name` read again from
    their env vars and files, bounded, and checked as at start: SecurityError names the key and
    why, never a value. TLS material and every other setting stay `creds`'. A running process's
    environment does not change: only a file can bring a new value (`credential_sources`)."""
    replica_token = secret = None
    if creds.bound_replica_tokens and name == BROKER_CALLER_ID:
        # The broker (and `kvrelay up`, which starts it) holds the secret and no token of its own.
        secret = _read_secret(cfg.replica_secret_env, cfg.replica_secret_file, "replica_secret")
    else:
        # `{name}` gives each replica its own file (bound mode: `kvrelay token NAME` > it).
        token_file = replica_token_file_for(cfg, name)
        replica_token = _read_secret(cfg.replica_token_env, token_file, "replica_token")
    creds = dataclasses.replace(
        creds,
        api_token=_read_secret(cfg.api_token_env, cfg.api_token_file, "api_token"),
        replica_token=replica_token,
        replica_secret=secret,
        operator_token=_read_secret(cfg.operator_token_env, cfg.operator_token_file, "operator_token"),
    )
    tokens = [t for t in (creds.api_token, creds.replica_token, creds.operator_token, secret) if t]
    if len(set(tokens)) != len(tokens):
        raise SecurityError(
            "security: the api, replica and operator tokens (and the replica secret) must differ "
            "(each names a caller class)"
        )
    if tokens and not creds.authenticates_replicas:
        # An api or operator token alone would leave the replica RPCs (register, deregister,
        # report, release) open to anyone: refuse rather than protect the wrong half.
        raise SecurityError(
            "security.replica_token_env / security.replica_token_file: an api or operator token is set but "
            "no replica token (nor security.tls.require_client_cert); replica RPCs would be open to anyone"
        )
    return creds


@dataclass(frozen=True, slots=True)
class CredentialSource:
    """Where one credential of a process comes from: `key` is the Credentials field
    (`replica_secret`, `replica_token`, `api_token`, `operator_token`); `file` when a file gives
    it (re-readable while running), else `env`, the variable read at start (a running process
    cannot see a new value there), else nowhere. The broker's reload reads these
    (`credential_sources`), and so does a replica re-reading its own token
    (kvrelay.replica_token, `replica_token_source`)."""

    key: str
    file: str | None = None
    env: str | None = None

    @property
    def reloadable(self) -> bool:
        return self.file is not None

    def describe(self) -> str:
        if self.file is not None:
            return f"security.{self.key}_file ({self.file})"
        if self.env:
            return f"security.{self.key}_env (${self.env})"
        return "none"


def replica_token_source(file: str | None = None, env: str | None = None) -> CredentialSource:
    """Where a replica's token comes from: its file (`security.replica_token_file`, `{name}`
    filled in), else an environment variable (`security.replica_token_env`), else nowhere."""
    return CredentialSource("replica_token", file, env)


def credential_sources(cfg: SecurityConfig, name: str = BROKER_CALLER_ID) -> tuple[CredentialSource, ...]:
    """Where each credential the process `name` reads comes from (as `reload_tokens` reads
    them; a source that names neither a file nor a variable is left out)."""
    bound = cfg.replica_tokens == "bound"
    own = (
        CredentialSource("replica_secret", cfg.replica_secret_file, cfg.replica_secret_env)
        if bound and name == BROKER_CALLER_ID
        else CredentialSource("replica_token", replica_token_file_for(cfg, name), cfg.replica_token_env)
    )
    sources = (
        own,
        CredentialSource("api_token", cfg.api_token_file, cfg.api_token_env),
        CredentialSource("operator_token", cfg.operator_token_file, cfg.operator_token_env),
    )
    return tuple(
        dataclasses.replace(s, env=None) if s.file else s for s in sources if s.file or s.env
    )


def replica_token_file_for(cfg: SecurityConfig, name: str) -> str | None:
    """The file replica `name` reads its token from (`{name}` filled in), or None when its token
    comes from an environment variable (`security.replica_token_env`)."""
    return cfg.replica_token_file.replace("{name}", name) if cfg.replica_token_file else None


def read_replica_token_file(path: str) -> str:
    """The replica token in `path`, checked as at start (bounded read of a regular file, UTF-8,
    printable ASCII, not empty); SecurityError names the file and why, never its content."""
    token = _read_secret(None, path, "replica_token")
    assert token is not None  # a file either yields a token or raises
    return token


def read_replica_secret(cfg: SecurityConfig) -> str | None:
    """The broker's secret of bound replica tokens, from its env var or file (None if unset)."""
    return _read_secret(cfg.replica_secret_env, cfg.replica_secret_file, "replica_secret")


def node_token_env(
    cfg: SecurityConfig, names: Sequence[str], make_secret: Callable[[], str] | None = None
) -> dict[str, dict[str, str]]:
    """Bound replica tokens on one node (`kvrelay up`): the environment each child needs, by
    name. The broker gets the secret (this process's, else one made for the node, which then
    binds only its own children); each replica its own token (unless `replica_token_file` gives
    it one: `{name}` in the path) and never the secret, though the node's environment has it, nor
    the api and operator tokens (a replica calls no public or operator RPC; with them, whoever took
    over one replica process would act as an operator: forget, deregister or cancel anything)."""
    if cfg.replica_tokens != "bound":
        return {}
    secret = read_replica_secret(cfg)
    broker_env: dict[str, str] = {}
    if secret is None and cfg.replica_token_file:
        # Tokens in files were derived from a secret: one made up now would match none of them.
        raise SecurityError("security.replica_secret_env / security.replica_secret_file: the replicas' token files "
                            "(security.replica_token_file) derive from the broker's secret; set it for the node too")
    if secret is None and BROKER_CALLER_ID not in names:
        # Replicas of a broker elsewhere: their tokens derive from that broker's secret.
        raise SecurityError("security.replica_secret_env / security.replica_secret_file: this node's replicas "
                            "register with a broker elsewhere; their tokens derive from its secret: set it here, or "
                            "give each its own token file (security.replica_token_file with {name})")
    if secret is None:
        if not cfg.replica_secret_env:
            raise SecurityError("security.replica_secret_env: bound replica tokens need the broker's secret "
                                "(an environment variable or security.replica_secret_file)")
        secret = (make_secret or (lambda: secrets.token_hex(32)))()
        broker_env[cfg.replica_secret_env] = secret
    if not cfg.replica_token_file and not cfg.replica_token_env:
        raise SecurityError("security.replica_token_env: bound replica tokens: the replicas need a way to get "
                            "their own (an environment variable, or security.replica_token_file with {name})")
    out: dict[str, dict[str, str]] = {}
    for name in names:
        if name == BROKER_CALLER_ID:
            out[name] = dict(broker_env)
            continue
        env = {var: "" for var in (cfg.replica_secret_env, cfg.api_token_env, cfg.operator_token_env) if var}
        if not cfg.replica_token_file and cfg.replica_token_env:
            env[cfg.replica_token_env] = replica_token_for(secret, name)
        out[name] = env
    return out


def require_bound_credential(creds: Credentials, name: str) -> None:
    """Bound replica tokens: refuse to start the broker without its secret, or a replica
    without its own token (each names the setting and the fix)."""
    if not creds.bound_replica_tokens:
        return
    if name == BROKER_CALLER_ID and not creds.replica_secret:
        raise SecurityError(
            "security.replica_secret_env / security.replica_secret_file: security.replica_tokens is bound but "
            "the broker has no secret to check replica tokens with ($KVRELAY_REPLICA_SECRET)"
        )
    if name != BROKER_CALLER_ID and not creds.replica_token:
        raise SecurityError(
            f"security.replica_token_env / security.replica_token_file: security.replica_tokens is bound but "
            f"{name} has no token of its own (`kvrelay token {name}` prints it, from the broker's secret)"
        )


def is_loopback(host: str) -> bool:
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def check_bind(host: str, creds: Credentials, insecure_bind: bool, what: str) -> None:
    """Refuse a non-loopback listener that would trust every caller (DESIGN.md section 11)."""
    if is_loopback(host) or insecure_bind or creds.authenticates_replicas:
        return
    raise SecurityError(
        f"{what}: refusing to listen on {host} without credentials: set a replica token "
        "($KVRELAY_REPLICA_TOKEN or security.replica_token_file) or security.tls with "
        "require_client_cert, or pass --insecure-bind to accept any caller on this network"
    )


# ---------------------------------------------------------------- channels


@dataclass(frozen=True, slots=True)
class ChannelSecurity:
    """How one channel authenticates, and how it notices a dead connection (its keepalive):
    picklable, so rank workers get it from their spec."""

    token: str | None = None
    replica_id: str | None = None
    tls: TlsMaterial | None = None
    keepalive: Keepalive = DEFAULT_KEEPALIVE

    def metadata(self) -> tuple[tuple[str, str], ...]:
        md: list[tuple[str, str]] = []
        if self.token:
            md.append((AUTHORIZATION_METADATA, f"Bearer {self.token}"))
        if self.replica_id:
            md.append((REPLICA_ID_METADATA, self.replica_id))
        return tuple(md)


def channel_options(
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, keepalive: Keepalive = DEFAULT_KEEPALIVE
) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_request_bytes),
        ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
        *keepalive.channel_options(),
    ]


def _channel_credentials(tls: TlsMaterial) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=tls.root_certificates, private_key=tls.private_key, certificate_chain=tls.cert_chain
    )


def _tls_options(tls: TlsMaterial | None) -> list[tuple[str, Any]]:
    if tls is not None and tls.server_name:
        return [("grpc.ssl_target_name_override", tls.server_name)]
    return []


_SYNC_CLIENT_INTERCEPTORS: tuple[Any, ...] = (
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
)


Metadata = tuple[tuple[str, str], ...]


class _AioMetadata:
    def __init__(self, metadata: Callable[[], Metadata]) -> None:
        # Asked on every call: a replica that reloads its token file presents the new token on
        # its next call, on the same channel (kvrelay.replica_token).
        self._metadata = metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        md = grpc.aio.Metadata(*(tuple(details.metadata or ()) + self._metadata()))
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, md, details.credentials, details.wait_for_ready
        )


# grpc.aio files an interceptor under the first call kind it implements only, so each kind gets
# its own object.
class _AioUnaryUnary(_AioMetadata, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioMetadata, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioMetadata, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_AioMetadata, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


def _aio_interceptors(metadata: Callable[[], Metadata]) -> list[Any]:
    return [kind(metadata) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


class _SyncCallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, method: str, timeout: Any, metadata: Any, credentials: Any, wait_for_ready: Any,
                 compression: Any) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


class _SyncMetadataInterceptor(*_SYNC_CLIENT_INTERCEPTORS):  # type: ignore[misc]
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, d: Any) -> _SyncCallDetails:
        md = tuple(d.metadata or ()) + self._metadata
        return _SyncCallDetails(d.method, d.timeout, md, d.credentials, getattr(d, "wait_for_ready", None),
                                getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


def make_channel(
    target: str,
    security: ChannelSecurity | None = None,
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    options: Sequence[tuple[str, Any]] = (),
    live_metadata: Callable[[], Metadata] | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to `target`: TLS when `security.tls` is set, token and replica id on
    every call, message size limits explicit, HTTP/2 keepalive on (`Keepalive`).
    `live_metadata`, when given, is asked for the token and id on every call instead of
    `security`'s (a replica whose token file may be reloaded: kvrelay.replica_token)."""
    security = security or ChannelSecurity()
    opts = [*channel_options(max_request_bytes, security.keepalive), *_tls_options(security.tls), *options]
    interceptors = None
    if live_metadata is not None:
        interceptors = _aio_interceptors(live_metadata)
    elif md := security.metadata():
        interceptors = _aio_interceptors(lambda: md)
    if security.tls is not None:
        return grpc.aio.secure_channel(target, _channel_credentials(security.tls), options=opts,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)


def make_sync_channel(
    target: str,
    security: ChannelSecurity | None = None,
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """The blocking twin of `make_channel` (supervisor health checks, transport threads)."""
    security = security or ChannelSecurity()
    opts = [*channel_options(max_request_bytes, security.keepalive), *_tls_options(security.tls), *options]
    if security.tls is not None:
        channel = grpc.secure_channel(target, _channel_credentials(security.tls), options=opts)
    else:
        channel = grpc.insecure_channel(target, options=opts)
    md = security.metadata()
    return grpc.intercept_channel(channel, _SyncMetadataInterceptor(md)) if md else channel


# How a channel is dialled: `make_channel`'s signature (kvrelay.server_tls.renewing_dial: one whose
# client certificate follows the pair the process serves).
ChannelDial = Callable[..., grpc.aio.Channel]


class ChannelCache:
    """One grpc.aio channel per target, all dialed with one `ChannelSecurity` (`dial`, by default
    `make_channel`).

    For a caller that reaches many peers by address, again and again (the broker dialing its AR
    and DiT replicas' endpoints): a channel is opened on first use and kept until `close`, or
    until `forget` drops it after a failed connection.
    Single-threaded: one event loop is its only caller.
    """

    def __init__(
        self, security: ChannelSecurity | None = None,
        per_replica: Callable[[str | None], ChannelSecurity] | None = None,
        dial: ChannelDial = make_channel,
    ) -> None:
        self._security = security
        self._dial = dial
        # The credential depends on the replica dialled (the broker's bound call tokens): one
        # channel per (target, replica id), so a replica moved to another's address never gets
        # the other's token.
        self._per_replica = per_replica
        self._channels: dict[tuple[str, str | None], grpc.aio.Channel] = {}
        # Forgotten channels still closing (their running calls get a grace period).
        self._closing: dict[asyncio.Task[None], grpc.aio.Channel] = {}

    def get(self, target: str, replica_id: str | None = None) -> grpc.aio.Channel:
        """The channel to `target`, where the replica `replica_id` serves."""
        key = (target, replica_id if self._per_replica is not None else None)
        channel = self._channels.get(key)
        if channel is None:
            per_replica = self._per_replica
            security = per_replica(replica_id) if per_replica is not None else self._security
            # Per replica, the token is asked on every call: it changes with a rotation of the
            # broker's credentials (CredentialRotation.broker_channel), on the same channel.
            live = (lambda: per_replica(replica_id).metadata()) if per_replica is not None else None
            # A local subchannel pool: by default channels to one target share gRPC's global
            # subchannel, backoff included, and a fresh channel would inherit the failed one's.
            channel = self._dial(target, security, options=[("grpc.use_local_subchannel_pool", 1)],
                                 live_metadata=live)  # fmt: skip
            self._channels[key] = channel
        return channel

    def forget(self, target: str, grace_s: float = FORGOTTEN_CHANNEL_GRACE_S) -> None:
        """Drop the channel to `target` after a call on it failed to connect; the next `get`
        dials afresh. A channel whose connection failed waits out gRPC's reconnect backoff
        (growing to 2 minutes) and fails every call at once meanwhile, so a replica restarted
        at the same address stayed unreachable long after it was serving. Calls still running
        on the old channel get `grace_s` to finish before it closes."""
        for key in [k for k in self._channels if k[0] == target]:
            channel = self._channels.pop(key)
            task = asyncio.get_running_loop().create_task(channel.close(grace_s))
            self._closing[task] = channel
            task.add_done_callback(lambda t: self._closing.pop(t, None))

    async def close(self) -> None:
        """Close every channel (their calls end CANCELLED); a later `get` dials again."""
        for task, channel in list(self._closing.items()):
            task.cancel()
            await channel.close()
        self._closing.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


# ---------------------------------------------------------------- servers


# A connection that has not finished its handshake (TLS, then the HTTP/2 preface and settings)
# within this is closed. gRPC's default is 120 s: an anonymous peer that opened ~20000 TCP
# connections and sent nothing left the broker without file descriptors, refusing every client.
SERVER_HANDSHAKE_TIMEOUT_MS = 10_000
# A call whose request message has not arrived within this after its headers is ended
# (DEADLINE_EXCEEDED / REQUEST_MESSAGE_TIMEOUT; RequestMessageDeadline). grpc.aio keeps a task per
# call waiting for the message, before any credential is checked: an anonymous peer that sent
# 20000 streams' headers and never their messages grew the broker by 445 MB, for as long as it
# held them. A real client sends the message with the headers.
REQUEST_MESSAGE_TIMEOUT_S = 10.0
# ... and at most this many calls of one peer host wait for theirs at once (one connection's
# streams, grpc.max_concurrent_streams below): a peer cannot hold more by opening connections.
MAX_WAITING_CALLS_PER_HOST = 1024
# File descriptors a server keeps for itself beyond its incoming connections: the journal, its
# own channels to replicas, the metrics listener, worker pipes, model files.
RESERVED_FDS = 256
MIN_INCOMING_CONNECTIONS = 64


def _open_files_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def max_incoming_connections() -> int:
    """Connections a server accepts at once: what the open-files limit leaves after RESERVED_FDS
    (gRPC closes any further one at once instead of the process running out of descriptors)."""
    limit = _open_files_limit()
    if limit == resource.RLIM_INFINITY:
        return 1 << 20
    return max(MIN_INCOMING_CONNECTIONS, limit - RESERVED_FDS)


class RequestMessageDeadline(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The outermost interceptor but metrics: serves each unary-request method as a
    client-streaming one that reads its one message itself, within REQUEST_MESSAGE_TIMEOUT_S
    (else DEADLINE_EXCEEDED / REQUEST_MESSAGE_TIMEOUT), with at most
    MAX_WAITING_CALLS_PER_HOST calls of one peer host waiting for theirs (one more is
    RESOURCE_EXHAUSTED / TOO_MANY_WAITING_CALLS at once); a call half-closed with no message is
    INVALID_ARGUMENT / NO_REQUEST_MESSAGE. grpc.aio itself waits for a unary request's message
    with no bound but the caller's own deadline, in a task of its own per call, before any
    interceptor sees the request (so before any credential is checked), and a call half-closed
    with no message it left open, with no status, until the caller went away. The wire is the
    same: a client cannot tell a method served so from one served unary."""

    def __init__(self) -> None:
        self._waiting: collections.Counter[str] = collections.Counter()

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        method: str = details.method
        read = self._the_request
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def single(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                return await unary(await read(method, context), context)

            return grpc.stream_unary_rpc_method_handler(
                single, handler.request_deserializer, handler.response_serializer
            )
        streamed = handler.unary_stream

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            result = streamed(await read(method, context), context)
            if not inspect.isasyncgen(result):
                await result  # a handler that writes with context.write
                return
            try:
                async for item in result:
                    yield item
            finally:
                await result.aclose()

        return grpc.stream_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)

    async def _the_request(self, method: str, context: grpc.aio.ServicerContext) -> Any:
        """The one request message of a unary-request call, read within the bounds above."""
        host = _peer_host(str(context.peer() or ""))
        if self._waiting[host] >= MAX_WAITING_CALLS_PER_HOST:
            await abort_with(context, KvRelayServerError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_WAITING_CALLS",
                f"{method}: {MAX_WAITING_CALLS_PER_HOST} calls from this host already wait for their request "
                "message (kvrelay.security.MAX_WAITING_CALLS_PER_HOST); send each message with its call",
            ))  # fmt: skip
        self._waiting[host] += 1
        try:
            async with asyncio.timeout(REQUEST_MESSAGE_TIMEOUT_S):  # no task of its own, as wait_for makes
                request = await context.read()
        except TimeoutError:
            await abort_with(context, KvRelayServerError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "REQUEST_MESSAGE_TIMEOUT",
                f"{method}: the request message did not arrive within {REQUEST_MESSAGE_TIMEOUT_S:g} s of the "
                "call's start (kvrelay.security.REQUEST_MESSAGE_TIMEOUT_S); send it with the call",
            ))  # fmt: skip
        finally:
            self._waiting[host] -= 1
            if self._waiting[host] <= 0:
                del self._waiting[host]
        if request is grpc.aio.EOF:
            await abort_with(context, KvRelayServerError(
                grpc.StatusCode.INVALID_ARGUMENT, "NO_REQUEST_MESSAGE",
                f"{method}: the call ended its requests without the one request message this method takes",
            ))  # fmt: skip
        return request

    def waiting(self) -> int:
        """Calls that wait for their request message now, of every host."""
        return sum(self._waiting.values())


def server_options(creds: Credentials) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", creds.max_request_bytes),
        ("grpc.max_send_message_length", MAX_REPLY_BYTES),
        ("grpc.so_reuseport", 0),
        # Bound what one peer can hold open.
        ("grpc.max_concurrent_streams", 1024),
        ("grpc.max_metadata_size", 16 * 1024),
        # Bound what idle sockets can hold: connections that never speak, and their number.
        ("grpc.server_handshake_timeout_ms", SERVER_HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_allowed_incoming_connections", max_incoming_connections()),
        *creds.keepalive.server_options(),
    ]


def server_credentials(creds: Credentials) -> grpc.ServerCredentials | None:
    if creds.tls is None:
        return None
    if creds.tls.cert_chain is None or creds.tls.private_key is None:
        raise SecurityError("security.tls: a server needs cert_file and key_file")
    return grpc.ssl_server_credentials(
        [(creds.tls.private_key, creds.tls.cert_chain)],
        root_certificates=creds.tls.root_certificates,
        require_client_auth=creds.tls.require_client_cert,
    )


# ---------------------------------------------------------------- rotation


# What a rotation replaces (kvrelay.security.reload_tokens reads them again): the credentials a
# caller presents or the broker derives what it presents from. Everything else of a Credentials
# (TLS material, limits, keepalive, the token mode) is the current one's, whichever generation a
# peer holds: TLS material changes without a generation (CredentialRotation.replace_current).
ROTATED_FIELDS: tuple[str, ...] = ("api_token", "replica_token", "operator_token", "replica_secret")


def with_rotated_of(current: Credentials, held: Credentials) -> Credentials:
    """`current` with the tokens and secret (ROTATED_FIELDS) of `held`, and nothing else of it."""
    return dataclasses.replace(current, **{f: getattr(held, f) for f in ROTATED_FIELDS})


@dataclass(frozen=True, slots=True)
class SupersededCredentials:
    """One generation of credentials a rotation replaced: taken until `until` (the rotation's
    clock) and numbered `generation` (0 = what the process started with, +1 per rotation)."""

    creds: Credentials
    until: float
    generation: int


class CredentialRotation:
    """The credentials one process takes and presents across rotations: the current ones, and
    each generation a reload replaced until its own grace ends (security.rotation_grace_seconds
    after the reload that replaced it), at most MAX_SUPERSEDED_GENERATIONS of them.

    A server checks a caller against all of them while their graces last (`AuthInterceptor`), so
    a caller still holding a replaced credential works until it has the new one; a call taken
    only by replaced credentials is `superseded` (the broker tells that replica to re-read its
    token file). A second rotation within a grace does not end the first one's: a replica still
    presenting the token of two rotations ago works until that generation's own deadline. Past
    MAX_SUPERSEDED_GENERATIONS the oldest generation is dropped at once (logged
    `credential_generation_dropped`). The broker also presents, to each replica, what that
    replica holds (`held_by`): the tokens and secret of the generation it last authenticated with
    (one not seen since the first rotation of the window: the oldest still taken), so no replica
    is handed a token derived from a secret it does not know; TLS material and every other
    setting are always the current ones. Touched on the event loop only (`grace_left_s`
    reads only, for a metrics thread); `clock` is monotonic seconds.
    """

    def __init__(self, current: Credentials, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._current = current
        self._clock = clock
        self._generation = 0
        # Newest first; each until its own deadline.
        self._superseded: list[SupersededCredentials] = []
        # Replica id -> the generation it last authenticated with, while any grace lasts.
        self._held: dict[str, int] = {}
        self.rotations = 0
        # Called (event loop) after every change of what is taken: broker.credential_grace
        # persists the window so that a broker restarted within it still honours it.
        self.on_change: Callable[[], None] | None = None

    @property
    def current(self) -> Credentials:
        return self._current

    def now(self) -> float:
        """This rotation's clock (the deadlines of `superseded` are on it)."""
        return self._clock()

    @property
    def generation(self) -> int:
        """The number of the current generation (0 at start, +1 per rotation)."""
        return self._generation

    def rotate(self, new: Credentials, grace_s: float | None = None) -> None:
        """Take `new` from now on, and the credentials held until now for `grace_s` more seconds
        (`new.rotation_grace_s` when None; 0: not at all). Generations replaced before keep
        their own deadlines."""
        grace = new.rotation_grace_s if grace_s is None else grace_s
        live = self.superseded()
        if grace > 0:
            live.insert(0, SupersededCredentials(self._current, self._clock() + grace, self._generation))
        for dropped in live[MAX_SUPERSEDED_GENERATIONS:]:
            log.warning("credential_generation_dropped", generation=dropped.generation,
                        grace_left_s=round(max(0.0, dropped.until - self._clock()), 1),
                        max_superseded_generations=MAX_SUPERSEDED_GENERATIONS,
                        consequence="its credentials are refused from now on, before their grace ended")  # fmt: skip
        self._superseded = live[:MAX_SUPERSEDED_GENERATIONS]
        self._current = new
        self._generation += 1
        self.rotations += 1
        self._changed()

    def replace_current(self, creds: Credentials) -> None:
        """Hold `creds` as the current generation itself, no rotation: what changed is no
        credential a caller presents (the broker's TLS certificate, kvrelay.server_tls)."""
        self._current = creds

    def restore(self, current_generation: int, superseded: Sequence[SupersededCredentials]) -> None:
        """Take `superseded` (their deadlines on this rotation's clock) beside the current
        credentials, numbered as before a restart (broker.credential_grace): no rotation."""
        now = self._clock()
        live = sorted((s for s in superseded if s.until > now), key=lambda s: -s.generation)
        self._superseded = live[:MAX_SUPERSEDED_GENERATIONS]
        self._generation = current_generation
        self._held.clear()

    def superseded(self) -> list[SupersededCredentials]:
        """The replaced generations still taken, newest first (a fresh list)."""
        now = self._clock()
        if self._superseded and self._superseded[-1].until <= now:
            self._superseded = [s for s in self._superseded if s.until > now]
            if not self._superseded:
                self._held.clear()
            self._changed()
        return list(self._superseded)

    def previous(self) -> Credentials | None:
        """The credentials replaced by the last rotation while its grace lasts, else None: its
        tokens and secret, with the current TLS material and settings (`held_by`)."""
        live = self.superseded()
        if live and live[0].generation == self._generation - 1:
            return with_rotated_of(self._current, live[0].creds)
        return None

    def grace_left_s(self, replica_id: str | None = None) -> float:
        """Seconds replaced credentials are still taken: of the generation `replica_id` holds
        (0 when it holds the current one), else until the last one ends (0 when none is).
        Reads only: a metrics scrape may ask from its own thread."""
        now = self._clock()
        live = [s for s in tuple(self._superseded) if s.until > now]
        if replica_id is not None:
            held = self._held_generation(replica_id, live)
            live = [s for s in live if s.generation == held]
        return max((s.until - now for s in live), default=0.0)

    def seen(self, replica_id: str, generation: int) -> None:
        """`replica_id` authenticated as a replica with the credentials of `generation` (the
        newest generation its credential belongs to)."""
        if not self.superseded():
            return
        if replica_id in self._held or len(self._held) < MAX_ROTATION_IDS:
            self._held[replica_id] = generation

    def _held_generation(self, replica_id: str | None, live: Sequence[SupersededCredentials]) -> int:
        if not live:
            return self._generation
        if replica_id is None or replica_id not in self._held:
            return live[-1].generation  # not seen in this window: the oldest still taken
        held = self._held[replica_id]
        return held if any(s.generation == held for s in live) else self._generation

    def held_by(self, replica_id: str | None) -> Credentials:
        """The credentials `replica_id` is known to hold: during a grace, the tokens and secret
        (ROTATED_FIELDS) of the generation it last authenticated with (the oldest still taken
        until it has), else the current ones. Only those: the TLS material, keepalive and limits
        are always the current ones (a certificate or CA reloaded after the rotation replaced no
        generation, and the broker dials every replica with what it serves now)."""
        live = self.superseded()
        held = self._held_generation(replica_id, live)
        old = next((s.creds for s in live if s.generation == held), None)
        return self._current if old is None else with_rotated_of(self._current, old)

    def shared_replica_tokens(self) -> tuple[str, ...]:
        """The shared replica tokens taken now (RegisterReplicaRequest.token): the current one,
        and those of every generation still in its grace."""
        tokens = (self._current.replica_token, *(s.creds.replica_token for s in self.superseded()))
        return tuple(dict.fromkeys(t for t in tokens if t))

    def broker_channel(self, replica_id: str | None) -> ChannelSecurity:
        """How the broker dials `replica_id` now (Credentials.broker_channel of what it holds)."""
        return self.held_by(replica_id).broker_channel(replica_id)

    def write_token(self, dit_replica_id: str, ar_replica_id: str) -> str:
        """What the broker hands `ar_replica_id` to write into `dit_replica_id` over PutKv: bound
        mode, the write token derived from the token the DiT holds; shared mode, during a grace
        the shared token the DiT holds (the AR may hold another one), else "" (the AR presents
        its own)."""
        held = self.held_by(dit_replica_id)
        if held.bound_replica_tokens:
            return held.write_token(dit_replica_id, ar_replica_id)
        if self.superseded():
            return held.replica_token or ""
        return ""

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


# ---------------------------------------------------------------- the interceptor


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling, as the interceptor established it."""

    classes: frozenset[CallerClass]
    # The replica id the caller acts as: bound by its certificate's common name, else declared
    # in `kvrelay-replica-id` metadata (trusted only as far as the replica token is).
    replica_id: str | None = None
    # A development deployment (no replica credential configured): every caller is trusted.
    trusted: bool = False
    # A valid credential was presented (token or verified client certificate).
    authenticated: bool = False
    # Bound replica tokens: why the bearer presented was not taken as a replica's ("" if it was).
    refusal: str = ""
    # Authenticated only by credentials a reload replaced, still taken for the grace period
    # (CredentialRotation): the caller should take its new ones.
    superseded: bool = False
    # Who a verified credential says the caller is, "" when none does: "replica:ID" (a bound
    # replica token, or a certificate whose common name is the replica's id or "broker"),
    # "client:CN" (another certificate of the CA), "operator:CN" (an operator certificate),
    # "operator" (the operator token). The shared replica token and the api token are one for
    # all their holders: they name nobody (`Caller.key` then falls back to the peer's address).
    identity: str = ""

    @property
    def operator(self) -> bool:
        """An operator acts on anything; in a development deployment, an undeclared caller is one."""
        if self.trusted:
            return self.replica_id is None
        return CallerClass.OPERATOR in self.classes

    def key(self, peer: str) -> str:
        """Whose share this call counts against (rate limits, the broker's queue): its verified
        identity, else "peer:HOST" (`peer` is grpc's context.peer())."""
        return self.identity or peer_key(peer)

    def acts_as(self, replica_id: str) -> bool:
        """May this caller act on `replica_id`'s behalf (its own id; anything when trusted and
        undeclared)."""
        if self.replica_id is None:
            return self.trusted
        return bool(replica_id) and hmac.compare_digest(self.replica_id.encode(), replica_id.encode())


_current_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("kvrelay_caller", default=None)


def current_caller() -> Caller | None:
    """The caller of the RPC being handled (None outside an intercepted handler)."""
    return _current_caller.get()


RequestCheck = Callable[[Any, Caller], Awaitable[None] | None]
"""A per-RPC check after authentication: raise KvRelayServerError (PERMISSION_DENIED) to refuse."""


def permission_denied(message: str) -> KvRelayServerError:
    return KvRelayServerError(grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED", message)


def _caller_named(what: str, accepts: Callable[[str], bool]) -> RequestCheck:
    def check(request: Any, caller: Caller) -> None:
        if caller.replica_id is None and caller.trusted:
            return
        if caller.replica_id is None or not accepts(caller.replica_id):
            raise permission_denied(f"only {what} may call this (caller: {caller.replica_id or 'undeclared'})")

    return check


# Checks of the replicas' own services (the broker registers its ticket checks, broker/authz.py).
REPLICA_SERVICE_CHECKS: Mapping[str, RequestCheck] = {
    _A + "Tokenize": _caller_named("the broker", lambda rid: rid == BROKER_CALLER_ID),
    _A + "Prefill": _caller_named("the broker", lambda rid: rid == BROKER_CALLER_ID),
    _D + "Denoise": _caller_named("the broker", lambda rid: rid == BROKER_CALLER_ID),
    _D + "PutKv": _caller_named("an AR replica", lambda rid: rid.startswith("ar-")),
}


class _RateLimiter:
    """Token buckets by key (a caller's identity, or a peer host); thread-safe (sync servers share
    it too). Bounded: at most `max_buckets` keys; a bucket that has refilled (idle for
    burst / rate seconds) is the same as none and is dropped first (least recently used first);
    a new key that finds every bucket busy shares one overflow bucket, so a flood of new keys is
    limited together instead of resetting anyone's bucket (before: past 10000 keys every bucket was
    cleared, and a caller with many addresses refilled everyone's)."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 max_buckets: int = MAX_RATE_BUCKETS) -> None:  # fmt: skip
        self._rate = rate
        self._burst = float(burst)
        self._clock = clock
        self._max = max_buckets
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        self._overflow: tuple[float, float] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._buckets)

    def _refilled(self, entry: tuple[float, float], now: float) -> bool:
        tokens, last = entry
        return tokens + (now - last) * self._rate >= self._burst

    def _take(
        self, entry: tuple[float, float] | None, now: float, cost: float, debt: bool
    ) -> tuple[float, tuple[float, float]]:
        """(0.0 when `cost` is taken, else the seconds until the bucket holds it; the entry after).
        `debt`: taken whatever the bucket holds, down to the burst below zero at most."""
        tokens, last = entry if entry is not None else (self._burst, now)
        tokens = min(self._burst, tokens + max(0.0, now - last) * self._rate)
        if debt:
            return 0.0, (max(tokens - cost, -self._burst), now)
        if tokens < cost:
            return (cost - tokens) / self._rate, (tokens, now)
        return 0.0, (tokens - cost, now)

    def _apply(self, key: str, cost: float, debt: bool) -> float:
        now = self._clock()
        with self._lock:
            entry = self._buckets.get(key)
            if entry is None:
                while self._buckets and self._refilled(next(iter(self._buckets.values())), now):
                    self._buckets.popitem(last=False)
                if len(self._buckets) >= self._max:
                    wait, self._overflow = self._take(self._overflow, now, cost, debt)
                    return wait
            wait, self._buckets[key] = self._take(entry, now, cost, debt)
            self._buckets.move_to_end(key)
            return wait

    def take(self, key: str, cost: float = 1.0) -> float:
        """Take `cost` tokens of `key`'s bucket (at most the burst: a call costlier than the burst
        still passes on a full bucket): 0.0, or the seconds until the bucket holds them (refused,
        nothing taken)."""
        if self._rate <= 0:
            return 0.0
        return self._apply(key, min(max(cost, 1.0), self._burst), debt=False)

    def allow(self, key: str, cost: float = 1.0) -> bool:
        """`take`, as whether it was taken."""
        return self.take(key, cost) == 0.0

    def charge(self, key: str, cost: float) -> None:
        """Take `cost` tokens of `key`'s bucket after the fact (the work is done): whatever it
        holds, into debt down to the burst below zero, so that the caller's next calls are refused
        until it has refilled (at most 2 x burst / rate seconds)."""
        if self._rate > 0 and cost > 0:
            self._apply(key, cost, debt=True)


# The RPCs a replica serves to the broker alone (REPLICA_SERVICE_CHECKS): the orchestration of
# generations the broker admitted, one Tokenize per Generate it admits and one Prefill/Denoise per
# ticket. Their number follows public traffic, which no rate limit bounds (GenerationService is
# public; broker.max_queue bounds it), so a replica does not rate-limit the broker's calls there:
# found black-box, a public client sending ~250 Generate/s with prompts the AR refuses ran the
# broker's bucket at the AR dry (security.rate_limit_per_second 50) and generations the broker had
# admitted, queued and placed failed RESOURCE_EXHAUSTED / RATE_LIMITED on Prefill and Denoise,
# other clients' too. Any other caller of a replica (an AR's PutKv) keeps its per-peer bucket.
_BROKER_ORCHESTRATION = frozenset({_A + "Tokenize", _A + "Prefill", _D + "Denoise"})


def _broker_orchestration(method: str, caller: Caller) -> bool:
    """A call of the broker (authenticated as the broker: its call token, the shared replica token
    with its id declared, its certificate) to one of _BROKER_ORCHESTRATION."""
    return (method in _BROKER_ORCHESTRATION and CallerClass.REPLICA in caller.classes
            and caller.replica_id == BROKER_CALLER_ID)  # fmt: skip


def peer_key(peer: str) -> str:
    """The key of a caller known only by its address: "peer:HOST" (grpc's context.peer())."""
    return "peer:" + _peer_host(peer)


def key_name(key: str) -> str:
    """A share's key as a caller is told it: "peer:10.0.0.2" -> "address 10.0.0.2",
    "replica:dit-3" -> "replica dit-3"."""
    kind, _, name = key.partition(":")
    return f"address {name}" if kind == "peer" else f"{kind} {name}".strip()


def _peer_host(peer: str) -> str:
    # "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path"
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0]
    return peer


# Repeated ids whose count the servicer bounds itself, from what the caller could hold: a DiT's
# RegisterReplicaRequest.held_ticket_ids, at most its pages (kvrelay.broker.core.listing_bounds).
_IDS_COUNTED_BY_SERVICER = frozenset({"held_ticket_ids"})


def check_id_lengths(message: Any, path: str = "", depth: int = 0) -> None:
    """Ids (fields named *_id / *_ids, at any depth) are at most MAX_ID_CHARS characters, a
    request_id at most kvrelay.limits.MAX_REQUEST_ID_LENGTH (refused with the broker's own message,
    kvrelay.limits.request_id_problem); at most 1024 in one repeated field unless its servicer bounds
    the count (_IDS_COUNTED_BY_SERVICER)."""
    if depth > 4:
        return
    for fd, value in message.ListFields():
        name = f"{path}{fd.name}"
        if fd.type == fd.TYPE_STRING and (fd.name.endswith("_id") or fd.name.endswith("_ids")):
            values = value if fd.label == fd.LABEL_REPEATED else [value]
            if len(values) > 1024 and fd.name not in _IDS_COUNTED_BY_SERVICER:
                raise KvRelayServerError(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT",
                                         f"{name}: at most 1024 ids", field=name)
            for v in values:
                if fd.name == "request_id" and len(v) > MAX_REQUEST_ID_LENGTH:
                    raise KvRelayServerError(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT",
                                             f"{name}: {request_id_problem(v)}", field=name)
                if len(v) > MAX_ID_CHARS:
                    raise KvRelayServerError(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT",
                                             f"{name}: longer than {MAX_ID_CHARS} characters", field=name)
        elif fd.type == fd.TYPE_MESSAGE and fd.message_type.full_name.startswith("kvrelay."):
            items = value if fd.label == fd.LABEL_REPEATED else [value]
            for item in items[:64]:
                check_id_lengths(item, f"{name}.", depth + 1)


@dataclass(frozen=True, slots=True)
class CredentialRefusal:
    """A replica id whose calls a server refused for their credential, since that server started
    or since the id last authenticated there (ListReplicasResponse.credential_refusals)."""

    replica_id: str
    reason: str  # REPLICA_TOKEN_MISMATCH, or UNAUTHENTICATED (no replica credential the server takes)
    method: str  # the last refused RPC, short name ("Heartbeat")
    refusals: int
    first_time: float  # seconds since the epoch
    last_time: float


class CredentialRefusals:
    """What a server knows of replicas it refuses (a rotated replica secret: replicas still on old
    tokens): a record per declared replica id (`ar-N`, `dit-N`; a call declaring none, or another
    name, is not kept), dropped when that id authenticates again. Bounded: MAX_REFUSAL_LOG_IDS ids
    (any id may be declared: the least recently refused goes), and one warning
    `replica_credential_refused` per id per REFUSAL_LOG_S, at most MAX_REFUSAL_LOGS_PER_WINDOW
    in any window of it. Touched on the event loop only."""

    def __init__(
        self, *, clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._monotonic = monotonic
        self._records: dict[str, CredentialRefusal] = {}
        self._next_log: dict[str, float] = {}
        self._window_end = 0.0
        self._logged_in_window = 0

    def refused(self, replica_id: str | None, method: str, reason: str, why: str) -> None:
        if not replica_id or not _names_a_replica(replica_id):
            return
        now, tick = self._clock(), self._monotonic()
        short = method.rsplit("/", 1)[-1]
        old = self._records.pop(replica_id, None)
        if old is None and len(self._records) >= MAX_REFUSAL_LOG_IDS:
            oldest = min(self._records.values(), key=lambda r: r.last_time)
            del self._records[oldest.replica_id]
            self._next_log.pop(oldest.replica_id, None)
        self._records[replica_id] = CredentialRefusal(
            replica_id, reason, short, (old.refusals if old else 0) + 1, old.first_time if old else now, now
        )
        if self._next_log.get(replica_id, 0.0) > tick:
            return
        if tick >= self._window_end:
            self._window_end, self._logged_in_window = tick + REFUSAL_LOG_S, 0
        if self._logged_in_window >= MAX_REFUSAL_LOGS_PER_WINDOW:
            return
        self._logged_in_window += 1
        self._next_log[replica_id] = tick + REFUSAL_LOG_S
        fix = (f"give {replica_id!r} the token `kvrelay token {replica_id}` prints where this broker's secret is "
               "(a replica secret rotated since it started?): in its security.replica_token_file, which it re-reads "
               "while refused, else restart it with it" if reason == "REPLICA_TOKEN_MISMATCH"
               else f"give {replica_id!r} the replica credential this server takes")  # fmt: skip
        log.warning("replica_credential_refused", replica_id=replica_id, method=short, reason=reason, why=why,
                    fix=fix, repeat_after_s=REFUSAL_LOG_S)  # fmt: skip

    def authenticated(self, replica_id: str) -> None:
        if self._records and self._records.pop(replica_id, None) is not None:
            self._next_log.pop(replica_id, None)

    def snapshot(self) -> list[CredentialRefusal]:
        """Every id refused now, by id."""
        return sorted(self._records.values(), key=lambda r: r.replica_id)


@dataclass
class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The one server interceptor of every kvrelay server (see the module docstring)."""

    creds: Credentials
    checks: Mapping[str, RequestCheck] = field(default_factory=dict)
    rules: Mapping[str, RpcRule] = field(default_factory=lambda: RPC_RULES)
    _limiter: _RateLimiter = field(init=False)
    _host_limiter: _RateLimiter = field(init=False)
    _public_limiter: _RateLimiter = field(init=False)

    _open_streams: int = field(init=False, default=0)
    # The replica ids whose calls this server refused for their credential (ListReplicas shows
    # the broker's): given by the server that serves them, else its own.
    refusals: CredentialRefusals = field(default_factory=lambda: CredentialRefusals())
    # What is taken across a reload (the current credentials, and the replaced ones for the grace
    # period): given by the process that reloads, else one of `creds` alone. `creds` is only the
    # start: every check reads `rotation.current`.
    rotation: CredentialRotation | None = None

    def __post_init__(self) -> None:
        # A bucket per verified identity, and one per peer host for callers that have none: kept
        # apart, so callers without an identity never crowd the identities' buckets out.
        self._limiter = _RateLimiter(self.creds.rate_limit_per_second, self.creds.rate_limit_burst)
        self._host_limiter = _RateLimiter(self.creds.rate_limit_per_second, self.creds.rate_limit_burst)
        # Public RPCs that are counted (RpcRule.cost: ListGenerations) have buckets of their own:
        # a public caller's reads never spend what a replica on its host (the shared replica
        # token, a development deployment: one bucket per host) needs for its Heartbeat.
        self._public_limiter = _RateLimiter(self.creds.rate_limit_per_second, self.creds.rate_limit_burst)
        self.checks = {**REPLICA_SERVICE_CHECKS, **self.checks}
        if self.rotation is None:
            self.rotation = CredentialRotation(self.creds)

    @property
    def _rotation(self) -> CredentialRotation:
        assert self.rotation is not None  # set by __post_init__
        return self.rotation

    # -- authentication --------------------------------------------------------------------------

    def authenticate(self, metadata: Sequence[tuple[str, Any]], auth_context: Mapping[str, Any]) -> Caller:
        rotation = self._rotation
        creds = rotation.current
        bearer = ""
        declared: str | None = None
        for key, value in metadata:
            if key == AUTHORIZATION_METADATA and isinstance(value, str):
                # RFC 7235: the scheme is case-insensitive ("bearer", "BEARER"), then 1*SP.
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer":
                    bearer = token.lstrip(" ")
            elif key == REPLICA_ID_METADATA and isinstance(value, str):
                declared = value[:MAX_ID_CHARS]
        classes = _token_classes(creds, bearer, declared)
        # A bound replica token is valid for the id declared alone: that id is proven.
        bound_id = creds.bound_replica_tokens and CallerClass.REPLICA in classes
        # During a rotation's grace the replaced generations too, each until its own deadline
        # (CredentialRotation): a class they alone give marks the caller superseded.
        generation = rotation.generation if CallerClass.REPLICA in classes else None
        old: set[CallerClass] = set()
        for gen in rotation.superseded():  # newest first
            taken = _token_classes(gen.creds, bearer, declared)
            if generation is None and CallerClass.REPLICA in taken:
                generation = gen.generation
            bound_id = bound_id or (gen.creds.bound_replica_tokens and CallerClass.REPLICA in taken)
            old |= taken
        superseded = bool(old - classes)
        classes |= old
        if declared and generation is not None:
            rotation.seen(declared, generation)
        refusal = ""
        if creds.bound_replica_tokens and bearer and not classes:
            refusal = self._bound_refusal(declared)
        replica_id = declared
        identity = f"replica:{declared}" if bound_id and declared else ""
        tls = creds.tls
        cn = _common_name(auth_context) if tls is not None and tls.require_client_cert else None
        if tls is not None and cn is not None:
            if cn in tls.operator_names:
                classes.add(CallerClass.OPERATOR)
                identity = identity or f"operator:{cn}"
            elif _names_a_replica(cn) or cn == BROKER_CALLER_ID:
                # A certificate per replica binds its id: claiming another one is refused.
                if declared is not None and declared != cn:
                    raise permission_denied(f"{REPLICA_ID_METADATA} {declared!r} differs from the certificate's {cn!r}")
                classes.add(CallerClass.REPLICA)
                replica_id = cn
                identity = f"replica:{cn}"
            elif cn in tls.replica_names:
                # A node certificate shared by the node's processes binds no id: with bound replica
                # tokens the token must (else its holder could declare any id, as with the shared token).
                if not creds.bound_replica_tokens:
                    classes.add(CallerClass.REPLICA)
            else:
                classes.add(CallerClass.PUBLIC)  # any other certificate of the CA: a client
                identity = identity or f"client:{cn}"
        if not creds.authenticates_replicas:
            # Development deployment: loopback-only by check_bind; trust every caller.
            return Caller(frozenset(CallerClass), replica_id, trusted=True)
        if not identity and CallerClass.OPERATOR in classes:
            identity = "operator"
        authenticated = bool(classes)
        # The public API takes the api token (or an operator's); a replica credential is not a
        # client's, unless the deployment leaves the public API open.
        if not creds.api_token or CallerClass.OPERATOR in classes:
            classes.add(CallerClass.PUBLIC)
        return Caller(frozenset(classes), replica_id, authenticated=authenticated, refusal=refusal,
                      superseded=superseded, identity=identity)  # fmt: skip

    def _bound_refusal(self, declared: str | None) -> str:
        """Why a bearer that is no credential here was refused: one line, naming no secret."""
        at_broker = bool(self._rotation.current.replica_secret)
        if not declared and at_broker:
            return (f"the token presented is not accepted on a replica RPC without {REPLICA_ID_METADATA}: "
                    "the broker takes a replica's own token only with that replica's id declared "
                    "(security.replica_tokens: bound; `kvrelay token ID` prints replica ID's)")
        if not declared:
            # An AR or DiT: it holds no api or operator token, so those (as any other bearer) land here.
            return ("the token presented is not accepted on a replica RPC of this replica: it takes only "
                    f"the broker's call token ({REPLICA_ID_METADATA}: {BROKER_CALLER_ID}) and, on PutKv, "
                    "the write token the broker gave the ticket's AR; an api, operator or replica token "
                    "opens none (security.replica_tokens: bound)")
        if at_broker:
            return (f"the token presented is not the replica token of {declared!r} (security.replica_tokens: "
                    f"bound: a replica token acts only as its own id; `kvrelay token {declared}` prints it)")
        if declared == BROKER_CALLER_ID:
            return "the token presented is not the broker's call token for this replica (security.replica_tokens: bound)"
        return (f"the token presented is not {declared!r}'s write token for this replica (security.replica_tokens: "
                "bound: the broker hands it to the ticket's AR with Prefill)")

    # -- the interceptor -----------------------------------------------------------------------

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method: str = details.method
        rule = self.rules.get(method)
        check = self.checks.get(method)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._wrap_single_response(
                method, rule, check, handler.unary_unary, request_streaming=False))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._wrap_streamed_response(
                method, rule, check, handler.unary_stream, request_streaming=False))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._wrap_single_response(
                method, rule, check, handler.stream_unary, request_streaming=True))
        return handler._replace(stream_stream=self._wrap_streamed_response(
            method, rule, check, handler.stream_stream, request_streaming=True))

    async def _admit(
        self, method: str, rule: RpcRule | None, check: RequestCheck | None, request: Any,
        context: grpc.aio.ServicerContext,
    ) -> Caller:
        if rule is None:
            # Fail closed: an RPC nobody classified is nobody's.
            raise permission_denied(f"{method} has no caller class (kvrelay.security.RPC_RULES)")
        if rule.always_open:
            return Caller(frozenset({CallerClass.PUBLIC}))
        caller = self.authenticate(context.invocation_metadata() or (), context.auth_context() or {})
        allowed = {rule.caller_class} | ({CallerClass.OPERATOR} if rule.operator_too else set())
        if not caller.classes & allowed:
            needed = " or ".join(sorted(c.value for c in allowed))
            article = "an" if needed[0] in "aeiou" else "a"
            if caller.authenticated:
                raise permission_denied(f"{method} needs {article} {needed} credential; the one presented is not")
            if caller.refusal and CallerClass.REPLICA in allowed:
                self.refusals.refused(caller.replica_id, method, "REPLICA_TOKEN_MISMATCH", caller.refusal)
                raise KvRelayServerError(grpc.StatusCode.UNAUTHENTICATED, "REPLICA_TOKEN_MISMATCH",
                                         f"{method}: {caller.refusal}")
            if CallerClass.REPLICA in allowed:
                self.refusals.refused(caller.replica_id, method, "UNAUTHENTICATED",
                                      "no replica credential this server takes")  # fmt: skip
            raise KvRelayServerError(
                grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED",
                f"{method} needs {article} {needed} credential (authorization: Bearer <token> or a client certificate)",
            )
        if caller.replica_id and CallerClass.REPLICA in caller.classes:
            self.refusals.authenticated(caller.replica_id)
        if rule.cost is not None:
            # Streamed requests are not read here: they count 1.
            cost = 1.0 if request is None else rule.cost(request)
            self._rate_limit(caller, context, cost, method, public=rule.caller_class is CallerClass.PUBLIC)
        elif rule.caller_class is not CallerClass.PUBLIC and not _broker_orchestration(method, caller):
            self._rate_limit(caller, context)
        if request is not None and hasattr(request, "ListFields"):
            check_id_lengths(request)
        if check is not None:
            result = check(request, caller)
            if inspect.isawaitable(result):
                await result
        return caller

    def _rate_limit(
        self, caller: Caller, context: grpc.aio.ServicerContext, cost: float = 1.0, method: str = "",
        *, public: bool = False,
    ) -> None:
        """A bucket per verified identity (Caller.identity: a replica's own bound token or
        certificate, an operator), else per peer host (the shared replica token, a development
        deployment): replicas on one host no longer share one bucket. Found black-box: at
        rate_limit_per_second 50 an AR's Heartbeat failed RATE_LIMITED under normal load, its
        neighbours on the host having used the host's bucket at the broker."""
        limiter, key = self._bucket(caller, context, public)
        if wait := limiter.take(key, cost):
            counts = f"; {method.rsplit('/', 1)[-1]} counts as {cost:g}" if cost != 1.0 else ""
            if public and (rule := self.rules.get(method)) is not None and rule.reply_cost is not None:
                counts += " and its reply's bytes after it"
            # The client may wait exactly this long (google.rpc.RetryInfo, and ErrorInfo's
            # metadata retry_after_ms for the SDK's KvRelayError.details), never guess.
            wait_ms = max(1, math.ceil(wait * 1000))
            raise KvRelayServerError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED",
                f"more than {self.creds.rate_limit_per_second:g} requests/s from this caller ({key_name(key)}; "
                f"security.rate_limit_per_second{counts}); retry in {wait_ms / 1000:.3f} s",
                retry_delay_s=wait_ms / 1000,
                retry_after_ms=str(wait_ms),
            )

    def _bucket(
        self, caller: Caller, context: grpc.aio.ServicerContext, public: bool
    ) -> tuple[_RateLimiter, str]:
        """The bucket a call counts against, and its key there (see _rate_limit)."""
        limiter = self._public_limiter if public else self._limiter if caller.identity else self._host_limiter
        return limiter, caller.key(str(context.peer() or ""))

    def _charge_reply(
        self, rule: RpcRule | None, caller: Caller, context: grpc.aio.ServicerContext, reply: Any
    ) -> None:
        """The reply's share of its call's cost (RpcRule.reply_cost), taken after the fact."""
        if rule is None or rule.reply_cost is None or reply is None:
            return
        limiter, key = self._bucket(caller, context, rule.caller_class is CallerClass.PUBLIC)
        limiter.charge(key, rule.reply_cost(reply))

    def _wrap_single_response(self, method: str, rule: RpcRule | None, check: RequestCheck | None,
                              behavior: Callable[..., Any], *, request_streaming: bool) -> Callable[..., Any]:
        """A unary-unary or stream-unary handler: admitted (a streamed request is checked by its
        credential only), then run with the caller bound."""

        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                caller = await self._admit(method, rule, check, None if request_streaming else request, context)
            except KvRelayServerError as err:
                await abort_with(context, err)
            token = _current_caller.set(caller)
            try:
                reply = await behavior(request, context)
            finally:
                _current_caller.reset(token)
            self._charge_reply(rule, caller, context, reply)
            return reply

        return wrapper

    def _wrap_streamed_response(self, method: str, rule: RpcRule | None, check: RequestCheck | None,
                                behavior: Callable[..., Any], *, request_streaming: bool) -> Callable[..., Any]:
        """A unary-stream or stream-stream handler, in either style grpc.aio allows (an async
        generator, or a coroutine that writes with context.write)."""

        counted = rule is not None and rule.always_open

        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                caller = await self._admit(method, rule, check, None if request_streaming else request, context)
                if counted and self._open_streams >= MAX_OPEN_STREAMS:
                    raise KvRelayServerError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_STREAMS",
                        f"{method}: this server already holds {MAX_OPEN_STREAMS} streams of its open "
                        "RPCs (health Watch, reflection); retry later, or poll with Health/Check",
                    )
            except KvRelayServerError as err:
                await abort_with(context, err)
            token = _current_caller.set(caller)
            result = behavior(request, context)
            if counted:
                self._open_streams += 1
            try:
                if inspect.isasyncgen(result):
                    try:
                        async for item in result:
                            yield item
                    finally:
                        # A client that leaves while grpc sends an item abandons this generator
                        # at its `yield`; the loop's finaliser then closes it in a task of its
                        # own, in another context. Close the handler now (its cleanup runs here,
                        # not whenever it is collected), with the caller bound in this context.
                        _current_caller.set(caller)
                        await result.aclose()
                else:
                    await result
            finally:
                if counted:
                    self._open_streams -= 1
                # The token is of the context that admitted the call; a finaliser's context is
                # a throwaway copy, with nothing of ours to restore.
                with contextlib.suppress(ValueError):
                    _current_caller.reset(token)

        return wrapper

def _token_classes(creds: Credentials, bearer: str, declared: str | None) -> set[CallerClass]:
    """The caller classes `bearer` is a credential of under `creds`. Compares against every
    configured token, always, so timing tells nothing about which."""
    matches = {
        CallerClass.PUBLIC: _same(bearer, creds.api_token),
        CallerClass.OPERATOR: _same(bearer, creds.operator_token),
        CallerClass.REPLICA: (
            _same(bearer, _bound_token(creds, declared)) if creds.bound_replica_tokens
            else _same(bearer, creds.replica_token)
        ),
    }
    return {cls for cls, ok in matches.items() if ok}


def _bound_token(creds: Credentials, declared: str | None) -> str | None:
    """The one replica credential `creds` take from a caller declaring `declared` (bound replica
    tokens): the broker derives the replica's token from its secret; a replica accepts the
    broker's call token, or an AR's write token, derived from its own."""
    if not declared:
        return None
    if creds.replica_secret:
        return None if declared == BROKER_CALLER_ID else replica_token_for(creds.replica_secret, declared)
    if not creds.replica_token:
        return None
    if declared == BROKER_CALLER_ID:
        return broker_call_token(creds.replica_token)
    return put_kv_token(creds.replica_token, declared)


def _common_name(auth_context: Mapping[str, Any]) -> str | None:
    values = auth_context.get("x509_common_name") or ()
    for v in values:
        return v.decode() if isinstance(v, bytes) else str(v)
    return None


def _names_a_replica(name: str) -> bool:
    kind, _, index = name.partition("-")
    return kind in ("ar", "dit") and index.isdigit()


__all__ = [
    "AuthInterceptor",
    "CredentialRefusal",
    "CredentialRefusals",
    "BROKER_CALLER_ID",
    "Caller",
    "CallerClass",
    "ChannelCache",
    "ChannelDial",
    "ChannelSecurity",
    "CredentialRotation",
    "MAX_SUPERSEDED_GENERATIONS",
    "SupersededCredentials",
    "ROTATED_FIELDS",
    "with_rotated_of",
    "CredentialSource",
    "Credentials",
    "DEFAULT_KEEPALIVE",
    "Keepalive",
    "REPLICA_ID_METADATA",
    "RPC_RULES",
    "RequestCheck",
    "RpcRule",
    "SecurityError",
    "TlsMaterial",
    "broker_call_token",
    "channel_options",
    "check_bind",
    "client_tls_from_files",
    "credential_sources",
    "current_caller",
    "is_loopback",
    "load_credentials",
    "replica_token_source",
    "read_tls",
    "tls_files",
    "make_channel",
    "make_sync_channel",
    "node_token_env",
    "key_name",
    "peer_key",
    "permission_denied",
    "put_kv_token",
    "read_replica_secret",
    "read_replica_token_file",
    "reload_tokens",
    "replica_token_file_for",
    "replica_token_for",
    "require_bound_credential",
    "server_credentials",
    "server_options",
]
