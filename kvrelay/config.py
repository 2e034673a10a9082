"""Deployment configuration: the YAML of DESIGN.md section 10, validated at load.

Owns parsing and every startup rejection (stage graph, async_chunk, sleep mode with native
transfer, TP vs kv heads, AR/DiT geometry, transfer_timeout, unknown keys). Errors name the key.
Must never import torch or a service package: every process and the CLI load this.
"""

from __future__ import annotations

import math
import os
import types
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvrelay.broker_wait import DEFAULT_REGISTER_WAIT_SECONDS
from kvrelay.errors import MAX_DEADLINE_SECONDS
from kvrelay.limits import MAX_CONFIG_FILE_BYTES, FileRefused, read_bounded_file
from kvrelay.suggest import did_you_mean
from kvrelay.transfer.layout import KvGeometry, PageLayout
from kvrelay.transfer.planner import MAX_CFG_ROWS

DEFAULT_CONFIG = "configs/single-node.yaml"
CONFIG_ENV = "KVRELAY_CONFIG"


def default_config_path() -> str:
    """The config a command without `--config` uses: $KVRELAY_CONFIG, else DEFAULT_CONFIG.

    The one resolution every subcommand shares (an explicit `--config` always wins over it).
    """
    return os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG

# Transfer connectors by config name (DESIGN.md section 5).
NATIVE_CONNECTORS = ("MooncakeConnector", "CudaIpcConnector")
# vLLM-engine AR stages route through kvrelay's own connector (never vLLM's MooncakeConnector).
VLLM_CONNECTOR = "KvRelayConnector"
# The keys kv_connector_extra_config accepts (docs/configuration.md lists each).
KV_CONNECTOR_EXTRA_KEYS = ("mooncake_protocol", "transfer_timeout", "verify_checksums", "device_name")


class ConfigError(ValueError):
    """A configuration that kvrelay refuses to start with; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML's `yes`/`true` would otherwise pass as 1 (`port: true` listened on port 1).
        field = cls.model_fields[info.field_name] if info.field_name else None
        if isinstance(value, bool) and field is not None and _is_number(field.annotation):
            raise ValueError(f"expected a number, got {str(value).lower()}")
        return value


def _is_number(annotation: Any) -> bool:
    """int/float, or an optional of one (`int | None`)."""
    if annotation in (int, float):
        return True
    args = [a for a in get_args(annotation) if a is not type(None)]
    return len(args) == 1 and args[0] in (int, float)


# The defaults of broker.image_reply_budget_bytes / image_reply_wait_seconds: 64 MiB is about six
# 2048x2048 PNGs (~10 MB each) in replies not yet read, at ~3x their size in the broker each.
DEFAULT_IMAGE_REPLY_BUDGET_BYTES = 64 * 1024 * 1024
DEFAULT_IMAGE_REPLY_WAIT_SECONDS = 10.0

# The shortest replica lease a config may set: heartbeats (lease / 3) stay RPCs, not a busy loop.
MIN_LEASE_SECONDS = 0.5
# The shortest rank_stall_seconds a config may set: four liveness beats (kvrelay.worker beats
# every 0.5 s), so a beat a loaded host schedules late is not taken for a stopped rank.
MIN_RANK_STALL_SECONDS = 2.0
# A liveness beat gap longer than this (three of kvrelay.worker's 0.5 s beats) ends a process's
# stall-free run: it was stopped (SIGSTOP, a frozen cgroup or VM), starved, or held in a native
# call that long. Shorter stops go unseen, so receiver_proof_window_seconds adds this gap.
STALL_GAP_SECONDS = 1.5
# The receiver's drain margin: a DiT rank (or the DiT's service process, which receives the
# gRPC-stream fallback) that runs reads what its socket holds within this long. Part of
# receiver_settle_seconds, and of receiver_proof_window_seconds (docs/broker.md, Draining).
RECEIVER_DRAIN_MARGIN_SECONDS = 1.0


class BrokerConfig(_Strict):
    # Not empty, as a stage's: `host: ''` loaded, and `kvrelay up` then said "refusing to listen on
    # without credentials" (an empty name) instead of naming the key (found black-box).
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(50051, ge=0, le=65535)
    metrics_port: int = Field(9400, ge=0, le=65535)
    journal_path: str = ".kvrelay/broker.sqlite"
    # Finite, as drain_quiet_seconds: `.inf` loaded, and a lease that never lapses keeps a replica
    # that is gone UP (requests still placed on it); a drain that never ends keeps every cancelled
    # ticket's pages until the pool is empty.
    lease_seconds: float = Field(10.0, gt=0, allow_inf_nan=False)
    heartbeat_seconds: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_queue: int = Field(256, ge=1)
    # Generations one client may hold in the queue (waiting for a ticket, or being admitted); one
    # more is RESOURCE_EXHAUSTED CLIENT_QUEUE_FULL (broker/admission.py). A client is the verified
    # identity of its credential (a client or operator certificate, the operator token), else its
    # peer address: the api token is one for every client and names none. None: three quarters of
    # max_queue (rounded up), so a quarter always stays for other clients and one client alone
    # is refused only past that (found black-box: one client that filled max_queue with
    # generations it detached from got every other client QUEUE_FULL).
    max_queue_per_client: int | None = Field(None, ge=1)
    result_ttl_seconds: float = Field(300.0, ge=0)
    max_results: int = Field(1024, ge=1)
    drain_quiet_seconds: float = Field(2.0, ge=0, allow_inf_nan=False)
    # How many times the broker runs a generation again: on another replica after the AR or DiT
    # replica serving it stopped answering (REPLICA_UNAVAILABLE), lost a rank (REPLICA_FAILED) or
    # was forgotten by force (REPLICA_FORGOTTEN), and with a fresh ticket (another AR/DiT pair if
    # one is up) after its KV transfer failed (TRANSFER_FAILED, TRANSFER_TIMEOUT, WRITE_FAILED); one budget for
    # both (kvrelay.broker.orchestrator, Orchestrator.retry). 0: never (the generation fails, and
    # the client resubmits). Bounded: each retry holds a place at the queue's head.
    max_replica_retries: int = Field(1, ge=0, le=16)
    # PNG bytes that replies carrying an image (GetGeneration, a terminal Generate event) may hold
    # at once until their calls end (broker/generation.py, ImageReplyBudget): bounds what peers
    # that never read their replies pin in the broker. A reply that does not fit waits up to
    # `image_reply_wait_seconds`, then is RESOURCE_EXHAUSTED IMAGE_REPLY_BUDGET_EXHAUSTED.
    image_reply_budget_bytes: int = Field(DEFAULT_IMAGE_REPLY_BUDGET_BYTES, ge=1)
    image_reply_wait_seconds: float = Field(DEFAULT_IMAGE_REPLY_WAIT_SECONDS, gt=0, le=3600, allow_inf_nan=False)
    # What registrations (any holder of the replica token) may make the broker hold: replica ids
    # (live, lapsed, deregistered and journaled ones; kvrelay.broker.registry.MAX_REPLICAS) and page
    # states across every DiT replica (num_pages x CFG groups, a byte each; MAX_TOTAL_PAGES). One
    # beyond either is RESOURCE_EXHAUSTED once no idle replica can be forgotten to make room.
    max_replicas: int = Field(256, ge=1, le=65536)
    max_total_pages: int = Field(1 << 26, ge=1, le=1 << 34)
    # Forget a replica that has been down this long and is safe to forget (not fenced, no live
    # ticket names it: BrokerCore.forget_refusal), as `kvrelay forget` would. None: never (the
    # operator forgets them). One restored from the journal counts as down from the broker's start.
    forget_down_replicas_after_seconds: float | None = Field(None, gt=0, allow_inf_nan=False)
    # How long an AR or DiT replica retries RegisterReplica at start while the broker does not
    # answer, before it exits with one line naming the address (kvrelay/broker_wait.py). The AR
    # waited 120 s and the DiT 30 s.
    register_wait_seconds: float = Field(DEFAULT_REGISTER_WAIT_SECONDS, gt=0, allow_inf_nan=False)
    # WatchTicket streams open at once, in all and per calling replica (kvrelay.broker.service,
    # MAX_WATCH_STREAMS*): one beyond is RESOURCE_EXHAUSTED TOO_MANY_STREAMS. A DiT holds one per
    # request it serves: a per-replica bound below the DiT stage's max_num_seqs is refused at load.
    max_watch_streams: int = Field(2048, ge=1, le=1 << 20)
    max_watch_streams_per_replica: int = Field(256, ge=1, le=1 << 20)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        # Secrets never sit in the YAML itself: they moved to `security:` (env var or file).
        if isinstance(data, dict):
            for key, new in _MOVED_BROKER_KEYS.items():
                if key in data:
                    raise ValueError(f"broker.{key} moved to {new} (see docs/operations.md, Security)")
        return data

    @field_validator("lease_seconds")
    @classmethod
    def _lease_floor(cls, value: float) -> float:
        # 0.0001 was accepted: every replica heartbeat in a busy loop (a core each), none ever UP,
        # and every request failed NO_AR_REPLICA while `kvrelay up` reported the node SERVING.
        if value < MIN_LEASE_SECONDS:
            raise ValueError(
                f"must be at least {MIN_LEASE_SECONDS:g} s (replicas heartbeat every lease_seconds / 3), got {value:g}"
            )
        return value

    @model_validator(mode="after")
    def _client_share_within_queue(self) -> BrokerConfig:
        if self.max_queue_per_client is not None and self.max_queue_per_client > self.max_queue:
            raise ValueError(
                f"max_queue_per_client ({self.max_queue_per_client}) is above max_queue ({self.max_queue}): a "
                "client's share is part of the queue (leave it unset for three quarters of max_queue)"
            )
        return self

    @property
    def queue_share_per_client(self) -> int:
        """max_queue_per_client, or by default three quarters of max_queue (rounded up)."""
        if self.max_queue_per_client is not None:
            return self.max_queue_per_client
        return self.max_queue - self.max_queue // 4

    @model_validator(mode="after")
    def _heartbeat_within_lease(self) -> BrokerConfig:
        if self.heartbeat_seconds is not None and self.heartbeat_seconds >= self.lease_seconds:
            raise ValueError(
                f"heartbeat_seconds ({self.heartbeat_seconds:g}) must be below lease_seconds ({self.lease_seconds:g}): "
                "a lease that lapses before the next heartbeat keeps every replica down"
            )
        return self

    @property
    def heartbeat_interval(self) -> float:
        return self.heartbeat_seconds if self.heartbeat_seconds is not None else self.lease_seconds / 3.0


_MOVED_BROKER_KEYS = {
    "api_token": "security.api_token_env / security.api_token_file",
    "registration_token": "security.replica_token_env / security.replica_token_file",
    "tls_cert": "security.tls.cert_file",
    "tls_key": "security.tls.key_file",
}


class TlsConfig(_Strict):
    """TLS on every listener and every channel of the deployment (one CA)."""

    # PEM certificate (chain) and key this process presents: as a server, and as a client when
    # the peer asks for one (mutual TLS). `{name}` in the path is the process (`broker`, `ar-0`,
    # `dit-1`), so each can have its own certificate; `kvrelay up` itself uses `broker`'s.
    cert_file: str
    key_file: str
    # PEM roots peers' certificates must chain to (servers check clients only with require_client_cert).
    ca_file: str
    # Mutual TLS: servers refuse a client without a certificate from `ca_file`. A verified
    # certificate's common name says who it is: `ar-N` / `dit-N` / `broker` (a replica, id bound),
    # one of `replica_names` (a node certificate its processes share), one of `operator_names`,
    # anything else a client of the public API.
    require_client_cert: bool = False
    # Name to check the server's certificate against when it differs from the dialled host.
    server_name: str | None = None
    # Client certificate common names that are operators (status, cancel any, deregister).
    operator_names: tuple[str, ...] = ("kvrelay-operator",)
    # Client certificate common names that are replicas declaring their id in metadata.
    replica_names: tuple[str, ...] = ("kvrelay-node",)


class SecurityConfig(_Strict):
    """Credentials of the control plane (DESIGN.md section 11; docs/operations.md, Security).

    Tokens come from an environment variable or a file, never from the YAML. Nothing set = a
    development deployment: only loopback listeners, every caller trusted.
    """

    api_token_env: str | None = "KVRELAY_API_TOKEN"
    api_token_file: str | None = None
    # `{name}` in replica_token_file is the process (`ar-0`, `dit-1`): each replica its own file.
    replica_token_env: str | None = "KVRELAY_REPLICA_TOKEN"
    replica_token_file: str | None = None
    # shared: one replica token for every replica; whoever holds it may act as any replica id.
    # bound: each replica has its own token, HMAC-SHA256 of its id under the broker's secret
    # (`kvrelay token ID`); a replica acts only as its own id, the shared token is refused
    # (docs/operations.md, Per-replica tokens). `kvrelay up` gives its children their tokens.
    replica_tokens: Literal["shared", "bound"] = "shared"
    # The secret bound replica tokens derive from: the broker's alone (never a replica's).
    replica_secret_env: str | None = "KVRELAY_REPLICA_SECRET"
    replica_secret_file: str | None = None
    operator_token_env: str | None = "KVRELAY_OPERATOR_TOKEN"
    operator_token_file: str | None = None
    tls: TlsConfig | None = None
    # Largest request message any kvrelay server accepts (replies may be larger: a PNG).
    max_receive_message_bytes: int = Field(8 * 1024 * 1024, ge=64 * 1024, le=1024 * 1024 * 1024)
    # Requests per second (and burst) one caller may make to non-public RPCs; 0 = no limit. A
    # caller is its verified identity (a bound replica token, a certificate, the operator token),
    # else its peer address (kvrelay.security.AuthInterceptor._rate_limit). Finite: `.inf` loaded.
    rate_limit_per_second: float = Field(2000.0, ge=0, allow_inf_nan=False)
    rate_limit_burst: int = Field(4000, ge=1)
    # HTTP/2 keepalive of every channel and listener (kvrelay.security.Keepalive): ping after this
    # long without one, close the connection (its calls end UNAVAILABLE) when no ack comes within
    # the timeout. Listeners accept pings every min(time / 2, 5 s). gRPC pings at most once a
    # second while no data flows.
    keepalive_time_seconds: float = Field(15.0, ge=1.0, le=7200)
    keepalive_timeout_seconds: float = Field(15.0, ge=0.1, le=600)
    # After a process reloads its credentials (the broker: `kvrelay rotate-secrets`; a replica: a
    # new token in its file), it still takes the ones they replaced for this long, so callers
    # still holding them keep working until they have the new ones (kvrelay.security.
    # CredentialRotation; docs/operations.md, Rotating the replica secret). At least a few
    # heartbeats: every replica learns of a rotation at its next heartbeat.
    rotation_grace_seconds: float = Field(300.0, ge=5.0, le=86400.0)


class ModelConfig(_Strict):
    preset: str | None = None
    engine: Literal["builtin", "vllm"] = "builtin"
    # kvrelay: a built-in preset (random weights, or a checkpoint of it at `path`);
    # bagel: a BAGEL-7B-MoT-layout directory at `path` (docs/models.md);
    # demo: the bundled demo model (a tiny BAGEL trained by scripts/train_demo.py), `path` optional.
    format: Literal["kvrelay", "bagel", "demo"] = "kvrelay"
    path: str | None = None
    tokenizer: str | None = None
    weight_seed: int = 0
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    # DiT stage only: "fp8" runs the big linears (qkv, o, gate/up, down) as FP8 e4m3 GEMMs
    # (kvrelay.models.fp8): a preset's transformer blocks, a BAGEL-format DiT's generation expert;
    # everything else stays in `dtype`.
    quantization: Literal["fp8"] | None = None
    # engine: vllm only: extra vLLM EngineArgs (checked by the AR at start: kvrelay.ar_service.vllm_engine).
    vllm_args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _preset_or_path(self) -> ModelConfig:
        if self.vllm_args and self.engine != "vllm":
            raise ValueError("model.vllm_args is for engine: vllm only")
        if self.engine == "vllm" and not self.path:
            raise ValueError("model.path is required with engine: vllm")
        if self.quantization is not None:
            if self.dtype == "float16":
                raise ValueError(
                    f"model.quantization: {self.quantization} GEMMs return bfloat16 on GPUs (bfloat16 or float32 on "
                    "the CPU), not float16: use dtype bfloat16 (or float32 on the CPU)"
                )
        if self.format != "kvrelay":
            if self.engine != "builtin":
                raise ValueError(f"model.format {self.format} runs on the built-in engine only")
            if self.preset is not None:
                raise ValueError(f"model.preset does not apply to format {self.format}: the directory fixes the shape")
            if self.format == "bagel" and not self.path:
                raise ValueError("model.path (the BAGEL checkpoint directory) is required with format: bagel")
            return self
        if self.preset is None and self.path is None:
            raise ValueError("model needs a preset or a path")
        return self


class KvTransferConfig(_Strict):
    kv_connector: str
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"]
    engine_id: str | None = None
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("kv_connector")
    @classmethod
    def _known_connector(cls, value: str) -> str:
        known = NATIVE_CONNECTORS + (VLLM_CONNECTOR,)
        if value not in known:
            raise ValueError(f"unknown kv_connector {value!r}{did_you_mean(value, known)}; expected one of {known}")
        return value

    @field_validator("kv_connector_extra_config")
    @classmethod
    def _check_extra(cls, extra: dict[str, Any]) -> dict[str, Any]:
        allowed = sorted(KV_CONNECTOR_EXTRA_KEYS)
        unknown = sorted(set(extra) - set(allowed))
        if unknown:
            named = ", ".join(f"{key!r}{did_you_mean(key, allowed)}" for key in unknown)
            raise ValueError(f"unknown key(s) {named}; allowed: {allowed}")
        protocol = extra.get("mooncake_protocol", "tcp")
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake_protocol must be 'tcp' or 'rdma'{did_you_mean(protocol, ('tcp', 'rdma'))}")
        if "transfer_timeout" in extra:
            timeout = extra["transfer_timeout"]
            if isinstance(timeout, bool) or not isinstance(timeout, int | float):
                raise ValueError("transfer_timeout must be a number of seconds")
            if not math.isfinite(timeout) or timeout <= 0:
                raise ValueError(f"transfer_timeout must be positive and finite, got {timeout}")
        if "verify_checksums" in extra and not isinstance(extra["verify_checksums"], bool):
            raise ValueError("verify_checksums must be true or false")
        return extra


class StageConfig(_Strict):
    stage_id: int
    kind: Literal["ar", "dit"]
    num_replicas: int = Field(1, ge=1)
    devices: str = "cpu"
    tensor_parallel_size: int = Field(1, ge=1)
    sequence_parallel_size: int = Field(1, ge=1)
    max_num_seqs: int = Field(1, ge=1)
    kv_cache_memory_bytes: int = Field(..., gt=0)
    # Tokens per KV page (the DiT's pages; DESIGN.md section 3).
    page_size: int = Field(16, ge=1, le=4096)
    host: str = Field("127.0.0.1", min_length=1)
    advertise_host: str = Field("127.0.0.1", min_length=1)
    port: int | None = Field(None, ge=0, le=65535)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    model: ModelConfig
    kv_transfer_config: KvTransferConfig | None = None
    enable_sleep_mode: bool = False
    enable_expert_parallel: bool = False
    # CFG-parallel (DiT only): the replica runs `cfg_parallel_size` groups of tp * sp ranks and group
    # g receives and computes CFG row g alone (row 0 prompt, row 1 negative), combined once per step.
    cfg_parallel_size: int = Field(1, ge=1)
    # Per-request deadline the broker gives a stage call when the client set none. At most
    # MAX_DEADLINE_SECONDS: 1e12 was accepted and every request without a client deadline failed
    # DEADLINE_EXCEEDED at once (gRPC cannot hold a deadline that far).
    request_timeout_seconds: float = Field(600.0, gt=0, le=MAX_DEADLINE_SECONDS)
    # A rank whose liveness beat is silent this long (stopped, frozen, hung past its own threads)
    # fail-stops its replica; None: KvRelayConfig.rank_stall_seconds_for's default. At least
    # MIN_RANK_STALL_SECONDS: 0.1 was accepted, below the beat's own 0.5 s period, and the DiT
    # fail-stopped within a second of every start (each request REPLICA_FAILED, found black-box).
    rank_stall_seconds: float | None = Field(None, ge=MIN_RANK_STALL_SECONDS, allow_inf_nan=False)

    @field_validator("devices")
    @classmethod
    def _cpu_or_gpu_indices(cls, value: str) -> str:
        if value.strip() == "cpu":
            return value
        indices = [d.strip().removeprefix("cuda:") for d in value.split(",")]
        if not all(d.isdigit() for d in indices):
            raise ValueError(f"must be \"cpu\" or comma-separated GPU indices such as \"0,1\", got {value!r}")
        return ",".join(indices)  # `cuda:N` entries as N

    @property
    def head_shards(self) -> int:
        """How many head shards the KV is split into: tp * sp (one per rank of a CFG group)."""
        return self.tensor_parallel_size * self.sequence_parallel_size

    @property
    def world_size(self) -> int:
        """Rank processes of one replica: cfg_parallel_size * tp * sp."""
        return self.cfg_parallel_size * self.head_shards

    @property
    def default_port(self) -> int:
        return 50061 if self.kind == "ar" else 50071

    def port_for(self, replica: int) -> int:
        """gRPC port of replica N: consecutive from the stage's base (0 = pick a free port)."""
        base = self.port if self.port is not None else self.default_port
        return 0 if base == 0 else base + replica

    def metrics_port_for(self, replica: int) -> int:
        base = self.metrics_port if self.metrics_port is not None else (9410 if self.kind == "ar" else 9420)
        return 0 if base == 0 else base + replica

    @model_validator(mode="after")
    def _replica_ports_fit(self) -> StageConfig:
        # Replica N listens on base + N: `port: 65535` with 2 replicas was accepted and `kvrelay up`
        # died in an OverflowError traceback binding 65536 (found black-box).
        last = self.num_replicas - 1
        for key, port in (("port", self.port_for(last)), ("metrics_port", self.metrics_port_for(last))):
            if port > 65535:
                raise ValueError(
                    f"{key}: replica {last} of num_replicas {self.num_replicas} would listen on {port} (the stage's "
                    f"{key} + the replica index), above 65535; lower {key} or num_replicas, or set {key}: 0 (free ports)"
                )
        return self

    @property
    def transport(self) -> str:
        """`mooncake`, `cuda_ipc` or `grpc` (the fallback when kv_transfer_config is absent)."""
        if self.kv_transfer_config is None:
            return "grpc"
        if self.kv_transfer_config.kv_connector == "CudaIpcConnector":
            return "cuda_ipc"
        return "mooncake"

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.kv_transfer_config.kv_connector_extra_config) if self.kv_transfer_config else {}

    @property
    def mooncake_protocol(self) -> str:
        return str(self.extra.get("mooncake_protocol", "tcp"))

    @property
    def transfer_timeout(self) -> float:
        return float(self.extra.get("transfer_timeout", 60.0))

    @property
    def verify_checksums(self) -> bool:
        return bool(self.extra.get("verify_checksums", True))

    def device_list(self) -> list[str]:
        if self.devices.strip() == "cpu":
            return ["cpu"]
        return [f"cuda:{d.strip()}" for d in self.devices.split(",") if d.strip()]

    def devices_for(self, replica: int) -> list[str]:
        """The device of each rank of replica N: `cpu`, or consecutive GPUs from `devices`."""
        devices = self.device_list()
        if devices == ["cpu"]:
            return ["cpu"] * self.world_size
        start = replica * self.world_size
        chosen = devices[start : start + self.world_size]
        if len(chosen) < self.world_size:
            # Fewer GPUs than ranks: ranks share GPUs round-robin (gloo then, DESIGN.md section 9).
            chosen = [devices[(start + i) % len(devices)] for i in range(self.world_size)]
        return chosen


class KvRelayConfig(_Strict):
    async_chunk: bool = False
    broker: BrokerConfig = Field(default_factory=BrokerConfig)  # type: ignore[arg-type]
    security: SecurityConfig = Field(default_factory=SecurityConfig)  # type: ignore[arg-type]
    stages: list[StageConfig]
    edges: list[dict[str, int]]

    @property
    def ar_stage(self) -> StageConfig:
        return next(s for s in self.stages if s.kind == "ar")

    @property
    def dit_stage(self) -> StageConfig:
        return next(s for s in self.stages if s.kind == "dit")

    def stage(self, kind: str) -> StageConfig:
        return self.ar_stage if kind == "ar" else self.dit_stage

    def with_advertise_host(self, kind: str, host: str) -> KvRelayConfig:
        """This config with stage `kind`'s `advertise_host` replaced (`kvrelay ar|dit
        --advertise-host`): one config file serves every host of a deployment, each process
        naming its own host's address instead of a per-host copy of the file."""
        if not host or host != host.strip() or any(c in host for c in "/ "):
            raise ConfigError(f"--advertise-host: an address or host name, got {host!r}")
        if host.count(":") == 1 or (host.startswith("[") and "]:" in host):
            raise ConfigError(f"--advertise-host: an address without a port, got {host!r} (the port is the stage's)")
        stages = [s.model_copy(update={"advertise_host": host}) if s.kind == kind else s for s in self.stages]
        return self.model_copy(update={"stages": stages})

    @property
    def rank_watch_interval(self) -> float:
        """How often a replica's watchdog checks its ranks (kvrelay.worker.watch_ranks)."""
        return min(1.0, self.broker.heartbeat_interval)

    @property
    def receiver_settle_seconds(self) -> float:
        """How long after a writer is proven gone (WRITER_GONE), or its write FAILED (the call
        ended, not the receiving), the broker holds its ticket's pages, and only frees them while
        the DiT replica is up: a DiT rank stopped at that moment may hold bytes of the sender in
        its socket buffer; it either runs again (and drains them) or stays silent until its
        watchdog kills it, within the DiT's stall limit plus one watch interval. One second of margin
        for the kill and the drain (RECEIVER_DRAIN_MARGIN_SECONDS). Paid only without proof that
        every receiver ran: `receiver_proof_window_seconds`."""
        return self.rank_stall_seconds_for(self.dit_stage) + self.rank_watch_interval + RECEIVER_DRAIN_MARGIN_SECONDS

    @property
    def receiver_proof_window_seconds(self) -> float:
        """How long every receiving process of a DiT replica (each rank, and its service process)
        must have run without a stall, reported by a heartbeat sent at least this long after a
        FAILED or WRITER_GONE write was resolved, for the broker to free that write's pages before
        `receiver_settle_seconds`: the drain margin, plus the beat gap under which a stop goes
        unseen (STALL_GAP_SECONDS), so that a stop shorter than that gap which
        overlapped the resolution has ended and been drained too (docs/broker.md, Draining)."""
        return RECEIVER_DRAIN_MARGIN_SECONDS + STALL_GAP_SECONDS

    def rank_stall_seconds_for(self, stage: StageConfig) -> float:
        """How long a rank of `stage` may be silent before its replica fail-stops: the stage's
        `rank_stall_seconds`, else `max(10 s, 3 x broker.lease_seconds)` (the beat comes from a
        thread of its own every 0.5 s, so only a stopped process or a native call holding the GIL
        that long is silent)."""
        if stage.rank_stall_seconds is not None:
            return stage.rank_stall_seconds
        return max(10.0, 3.0 * self.broker.lease_seconds)

    @model_validator(mode="after")
    def _check_deployment(self) -> KvRelayConfig:
        if self.async_chunk:
            raise ValueError("async_chunk: true is not supported: native AR->DiT transfer needs async_chunk: false")
        kinds = [(s.stage_id, s.kind) for s in self.stages]
        if sorted(kinds) != [(0, "ar"), (1, "dit")]:
            raise ValueError(f"stages: only the two-stage graph AR(0) -> DiT(1) is supported, got {kinds}")
        edges = [(e.get("from"), e.get("to")) for e in self.edges]
        if edges != [(0, 1)] or any(set(e) != {"from", "to"} for e in self.edges):
            raise ValueError(f"edges: only [{{from: 0, to: 1}}] (AR(0) -> DiT(1)) is supported, got {self.edges}")
        ar, dit = self.ar_stage, self.dit_stage
        if dit.enable_sleep_mode and dit.kv_transfer_config is not None:
            raise ValueError(
                "stages[1].enable_sleep_mode: sleep mode is not allowed on a DiT stage with native transfer "
                "(registered KV pages must stay mapped for the connector's lifetime)"
            )
        if (ar.kv_transfer_config is None) != (dit.kv_transfer_config is None):
            raise ValueError("kv_transfer_config: set it on both stages (native transfer) or on neither (fallback)")
        if ar.kv_transfer_config and dit.kv_transfer_config:
            if ar.kv_transfer_config.kv_connector not in (dit.kv_transfer_config.kv_connector, VLLM_CONNECTOR):
                raise ValueError("kv_transfer_config.kv_connector: AR and DiT stages must use the same connector")
            if ar.kv_transfer_config.kv_role == "kv_consumer":
                raise ValueError("stages[0].kv_transfer_config.kv_role: the AR stage is the kv_producer")
            if dit.kv_transfer_config.kv_role == "kv_producer":
                raise ValueError("stages[1].kv_transfer_config.kv_role: the DiT stage is the kv_consumer")
            # An AR without its own transfer_timeout bounds its writes by the DiT's: a DiT that
            # gives up after 5 s must not leave the AR's slot writing (and the ticket in doubt)
            # for the 60 s default.
            ar_extra = ar.kv_transfer_config.kv_connector_extra_config
            dit_timeout = dit.kv_transfer_config.kv_connector_extra_config.get("transfer_timeout")
            if "transfer_timeout" not in ar_extra and dit_timeout is not None:
                ar_extra["transfer_timeout"] = dit_timeout
        # CUDA IPC maps the DiT's device pool into the AR process: both stages on GPUs of one
        # host. Refused here, with the reason, instead of at a replica's start-up (where a
        # supervisor would restart it in a loop).
        if ar.kv_transfer_config and ar.kv_transfer_config.kv_connector == "CudaIpcConnector":
            for idx, stage in ((0, ar), (1, dit)):
                if stage.devices.strip() == "cpu":
                    raise ValueError(
                        f"stages[{idx}].devices: CudaIpcConnector copies GPU to GPU; this stage runs on the CPU "
                        "(use MooncakeConnector, or no kv_transfer_config for the gRPC fallback)"
                    )
            if ar.advertise_host != dit.advertise_host:
                raise ValueError(
                    "stages[1].advertise_host: CudaIpcConnector needs the AR and DiT stages on one host "
                    f"(advertise_host {ar.advertise_host!r} vs {dit.advertise_host!r}); use MooncakeConnector "
                    "across hosts"
                )
        if ar.model.engine == "vllm" and ar.transport not in ("mooncake", "grpc"):
            raise ValueError(f"stages[0].model.engine: vllm writes over mooncake or grpc, not {ar.transport}")
        if ar.model.engine == "vllm":
            check_vllm_kvcache_space(os.environ, ar.model.vllm_args)
        if ar.model.engine == "vllm" and ar.device_list() != ["cpu"]:
            # KvRelayConnector reads vLLM's CPU block layout only: on a GPU platform vLLM refused it
            # when the cache was registered, after the model had loaded (minutes for a real one).
            raise ValueError(
                f"stages[0].devices: {ar.devices!r}: engine: vllm runs on vLLM's CPU platform only in this "
                "build (KvRelayConnector reads vLLM's CPU KV block layout; docs/ar.md): set devices: cpu"
            )
        if ar.sequence_parallel_size != 1:
            raise ValueError("stages[0].sequence_parallel_size: the AR stage supports tensor parallelism only")
        if ar.cfg_parallel_size != 1:
            raise ValueError(
                "stages[0].cfg_parallel_size: CFG-parallel is the DiT's (the AR prefills every CFG row); "
                "set it on stages[1]"
            )
        if dit.cfg_parallel_size > MAX_CFG_ROWS:
            raise ValueError(
                f"stages[1].cfg_parallel_size: {dit.cfg_parallel_size} CFG groups but a request has at most "
                f"{MAX_CFG_ROWS} CFG rows (row 0 prompt, row 1 negative): use 1 or 2"
            )
        if dit.cfg_parallel_size > 1 and dit.model.format != "kvrelay":
            raise ValueError(
                f"stages[1].cfg_parallel_size: the {dit.model.format} DiT runner computes every CFG row on each "
                "rank; CFG-parallel needs a built-in preset (model.format: kvrelay)"
            )
        if dit.model.format == "kvrelay" and dit.model.preset is None:
            raise ValueError("stages[1].model.preset: required: it names the DiT's shape (path: DIR adds weights)")
        if dit.model.engine != "builtin":
            raise ValueError("stages[1].model.engine: the DiT runs the built-in engine")
        if ar.model.quantization is not None:
            raise ValueError(
                f"stages[0].model.quantization: {ar.model.quantization} is for the DiT stage (stages[1]); "
                "the AR runs unquantized"
            )
        # A DiT replica watches one ticket per request it serves: a bound below its max_num_seqs
        # would refuse its own watches (it then polls GetTicket and warns on every request).
        if dit.max_num_seqs > self.broker.max_watch_streams_per_replica:
            raise ValueError(
                f"broker.max_watch_streams_per_replica: {self.broker.max_watch_streams_per_replica} is below "
                f"stages[1].max_num_seqs ({dit.max_num_seqs}); a DiT replica watches one ticket per request"
            )
        return self


VLLM_KVCACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# kvrelay's value of VLLM_CPU_KVCACHE_SPACE for an `engine: vllm` AR when the environment has none.
VLLM_KVCACHE_DEFAULT_GIB = 1


def check_vllm_kvcache_space(environ: Any, vllm_args: dict[str, Any]) -> int | None:
    """The whole GiB of vLLM's CPU KV cache an `engine: vllm` AR gets from `VLLM_CPU_KVCACHE_SPACE`
    (None: unset or empty, kvrelay's default applies; ValueError naming the variable otherwise).

    vLLM reads the variable with `int()` deep in its start (a traceback after the model load for
    `1.5` or `512MiB`); a value it would read as no cache (0) or a negative one failed there too.
    `vllm_args.kv_cache_memory_bytes` is vLLM's setting in bytes, for a cache that is not a whole
    number of GiB: vLLM lets the variable override it, so both set is refused."""
    raw = environ.get(VLLM_KVCACHE_ENV)
    text = "" if raw is None else str(raw).strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(
            f"environment variable {VLLM_KVCACHE_ENV}={raw!r}: vLLM reads it as a whole number of GiB "
            f"(1, 2, 4, ...; kvrelay's default {VLLM_KVCACHE_DEFAULT_GIB}); for a cache of another size "
            "unset it and set stages[0].model.vllm_args.kv_cache_memory_bytes (bytes, e.g. 536870912 for 512 MiB)"
        )
    if "kv_cache_memory_bytes" in vllm_args:
        raise ValueError(
            f"environment variable {VLLM_KVCACHE_ENV}={raw!r} and stages[0].model.vllm_args.kv_cache_memory_bytes "
            "both size vLLM's KV cache (the variable would win): set one"
        )
    return int(text)


def _annotation_at(loc: tuple[int | str, ...]) -> Any:
    """The type at a location of KvRelayConfig (`("stages", 1, "model")` -> ModelConfig), optionals
    and lists unwrapped; None where the location is no field: what an error there may suggest."""
    node: Any = KvRelayConfig
    for part in loc:
        if isinstance(part, int) and get_origin(node) is list:
            node = get_args(node)[0]
        elif isinstance(part, str) and isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            node = node.model_fields[part].annotation
        else:
            return None
        if get_origin(node) in (Union, types.UnionType):  # `TlsConfig | None`, `Literal[...] | None`
            args = [a for a in get_args(node) if a is not type(None)]
            node = args[0] if len(args) == 1 else None
    return node


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            parent = _annotation_at(e["loc"][:-1])
            known = parent.model_fields if isinstance(parent, type) and issubclass(parent, BaseModel) else ()
            msg = "unknown key" + did_you_mean(e["loc"][-1] if e["loc"] else None, known)
        elif e["type"] == "literal_error":
            field = _annotation_at(e["loc"])
            choices = get_args(field) if get_origin(field) is Literal else ()
            msg += did_you_mean(e["input"], choices)
        # A whole-config check names its keys itself (`stages[1].model.preset: ...`).
        lines.append(f"{loc}: {msg}" if loc else msg)
    return config_problems(source, lines)


def config_problems(source: str, problems: list[str]) -> str:
    """The message of a refused config: the file, then each problem (`key: what is wrong`).

    One problem stays on one line (what a CLI prints as its one error line); several get a line each.
    """
    if len(problems) == 1:
        return f"invalid config {source}: {problems[0]}"
    return f"invalid config {source} ({len(problems)} problems):\n  " + "\n  ".join(problems)


def parse_config(data: Any, source: str = "<config>") -> KvRelayConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: the top level must be a mapping")
    try:
        cfg = KvRelayConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None
    try:
        check_model_geometry(cfg)
        check_tokenizer_files_of(cfg)
    except ConfigError as err:
        # The same shape as every other config error: which file, then the key and what is wrong.
        raise ConfigError(config_problems(source, [str(err).removeprefix("invalid config: ")])) from None
    return cfg


def check_tokenizer_files_of(cfg: KvRelayConfig) -> None:
    """Reject at load a tokenizer file no library may be handed (a pipe, a device, more than
    MAX_TOKENIZER_FILE_BYTES): the AR reads model.tokenizer, else its checkpoint's own, and a
    BAGEL-format stage its directory's tokenizer.json, once its model has loaded (minutes) or in
    vLLM's engine, where a pipe blocked the start. Only files on this machine; no file is read."""
    from kvrelay.models.formats import check_tokenizer_files, model_dir

    for idx, stage in enumerate(cfg.stages):
        model = stage.model
        path: str | None
        if model.tokenizer:
            key, path = "tokenizer", model.tokenizer
        elif stage.kind == "ar" or model.format in ("bagel", "demo"):
            key, path = "path", model_dir(model)
        else:
            continue
        if path is None or not os.path.lexists(path):
            continue  # not on this machine (or a hub name vLLM resolves): the AR says so at start
        try:
            check_tokenizer_files(path)
        except FileRefused as err:
            raise ConfigError(f"invalid config: stages[{idx}].model.{key}: {err}") from None


def check_model_geometry(cfg: KvRelayConfig) -> None:
    """Reject at load what can never run: TP not dividing kv heads, AR/DiT geometry that cannot match.

    Preset geometry comes from kvrelay.models.presets, imported lazily (it imports no torch);
    a checkpoint directory from its JSON files when it is on this machine, else at registration,
    where the broker names the field.
    """
    from kvrelay.models.formats import bagel_geometry, hf_geometry
    from kvrelay.models.presets import PRESETS, get_preset

    geometries: dict[str, tuple[int, int, int, str | None]] = {}
    for idx, stage in enumerate(cfg.stages):
        geometry: tuple[int, int, int, str | None]
        if stage.model.format != "kvrelay":
            # A BAGEL-format directory's llm_config.json (no torch); a directory not on this
            # machine is checked at registration.
            try:
                found = bagel_geometry(stage.model)
            except ValueError as err:
                raise ConfigError(f"invalid config: stages[{idx}].model.path: {err}") from None
            if found is None:
                continue
            geometry, what = found, f"model format {stage.model.format}"
            quantization = stage.model.quantization
            if quantization is not None and found[3] != "bfloat16" and stage.device_list() != ["cpu"]:
                # The directory's kvrelay.json may name the dtype (the demo's is float32): refused
                # here rather than by every rank at start-up.
                raise ConfigError(
                    f"invalid config: stages[{idx}].model.quantization: {quantization} on GPUs needs bfloat16 "
                    f"activations; {what} runs in {found[3]} here: set model.dtype: bfloat16"
                )
        elif stage.model.preset is None:
            # An AR `{path: DIR}` checkpoint (Llama/Qwen2 config.json), checked here rather than
            # by the broker refusing the AR's registration after every model has loaded.
            try:
                found_hf = hf_geometry(stage.model, on_cpu=stage.device_list() == ["cpu"])
            except ValueError as err:
                raise ConfigError(f"invalid config: stages[{idx}].model.path: {err}") from None
            if found_hf is None:
                continue
            geometry, what = found_hf, f"checkpoint {stage.model.path}"
        else:
            try:
                preset = get_preset(stage.model.preset)
            except (KeyError, ValueError) as err:
                raise ConfigError(f"invalid config: stages[{idx}].model.preset: {err}") from None
            geometry = (preset.num_layers, preset.num_kv_heads, preset.head_dim, stage.model.dtype or preset.dtype)
            what = f"preset {preset.name!r}"
            if stage.model.quantization is not None and preset.dit.is_moe:
                raise ConfigError(
                    f"invalid config: stages[{idx}].model.quantization: {stage.model.quantization} quantizes dense "
                    f"DiTs only, {what} is a MoE"
                )
        heads = geometry[1]
        # Every CFG group holds all heads: tp * sp shards divide them, whatever cfg_parallel_size.
        shards = stage.head_shards
        if heads % shards:
            key = "tensor_parallel_size" if stage.sequence_parallel_size == 1 else "sequence_parallel_size"
            raise ConfigError(
                f"invalid config: stages[{idx}].{key}: {shards} rank(s) must divide num_kv_heads={heads} "
                f"of {what}"
            )
        geometries[stage.kind] = geometry
        if (stage.kind == "dit" or stage.model.engine == "builtin") and geometry[3] is not None:
            # The DiT carves kv_cache_memory_bytes (per rank) into pages; the built-in AR stages
            # whole DiT pages of its rank's heads in it (the smallest request writes one page).
            # Refused here, not by the DiT after the broker and the AR are up, or by the AR on
            # every request of a node that reported SERVING.
            page_size = cfg.dit_stage.page_size
            layers, _, head_dim, dtype = geometry
            kv = KvGeometry(layers, heads, head_dim, dtype, page_size)  # type: ignore[arg-type]
            page_bytes = PageLayout(kv, num_shards=shards, shard=0).page_bytes
            if stage.kv_cache_memory_bytes < page_bytes:
                raise ConfigError(
                    f"invalid config: stages[{idx}].kv_cache_memory_bytes: {stage.kv_cache_memory_bytes} is "
                    f"smaller than one page ({page_bytes} bytes per rank at page_size {page_size} for "
                    f"{what}); raise it or lower stages[1].page_size"
                )
    if "ar" in geometries and "dit" in geometries:
        names = ("num_layers", "num_kv_heads", "head_dim", "dtype")
        differ = [n for n, a, d in zip(names, geometries["ar"], geometries["dit"], strict=True)
                  if a != d and a is not None and d is not None]  # fmt: skip
        if differ:
            field = differ[0]
            if field == "dtype":
                fix = "set the same model.dtype on both stages"
            else:
                # The DiT presets built for the AR's shape (e.g. `small` for a 4-layer, 4 kv head,
                # head_dim 32 checkpoint): a user bringing a checkpoint learns which DiT fits it.
                fitting = [name for name, p in PRESETS.items()
                           if (p.num_layers, p.num_kv_heads, p.head_dim) == geometries["ar"][:3]]  # fmt: skip
                fits = f" (DiT presets of the AR's shape: {', '.join(fitting)})" if fitting else ""
                fix = (
                    "the DiT attends over the AR's KV: give the DiT stage a model of the AR's num_layers, "
                    f"num_kv_heads and head_dim{fits}, or the AR one of the DiT's"
                )
            raise ConfigError(
                f"invalid config: stages: AR and DiT KV geometry differ in {field} "
                f"(AR {geometries['ar'][names.index(field)]}, DiT {geometries['dit'][names.index(field)]}): {fix}"
            )


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types here
    """yaml.SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last one
    silently, so a second `port:` under `broker:` (an edit that forgot the first) won without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges: its keys may be overridden on purpose
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # an unhashable key: the base class says so
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error on one line (its str() is several, with a caret drawing): where, then what."""
    mark = getattr(err, "problem_mark", None)
    where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or " ".join(str(err).split())
    context = getattr(err, "context", None)
    return f"{where}: {problem}" + (f" ({context})" if context else "")


def load_config(path: str | os.PathLike[str] | None = None) -> KvRelayConfig:
    """Load and validate a YAML config; `None` = configs/single-node.yaml (or $KVRELAY_CONFIG)."""
    from kvrelay.resources import resolve, shipped_names

    asked = path or default_config_path()
    chosen = resolve(asked, "configs")
    if chosen.is_dir():
        raise ConfigError(f"config {asked} is a folder, not a YAML file")
    if chosen.exists() and not chosen.is_file():
        # Read once here, a pipe would be empty for the next reader (kvrelay up copies it).
        raise ConfigError(f"config {asked} is not a regular file (a pipe or a device): give a YAML file")
    if not chosen.is_file():
        shipped = ", ".join(shipped_names("configs"))
        raise ConfigError(f"config file not found: {asked}" + (f" (shipped configs: {shipped})" if shipped else ""))
    try:
        text = read_bounded_file(chosen, MAX_CONFIG_FILE_BYTES, "YAML config").decode("utf-8")
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except FileRefused as err:
        # Larger than any config (read whole before: a file of gigabytes took that much memory),
        # or replaced by a pipe or a device since the checks above.
        raise ConfigError(f"config {asked}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid YAML in {chosen}{_yaml_problem(err)}") from None
    except UnicodeDecodeError as err:
        # A binary file, or a config saved in another encoding: YAML here is UTF-8.
        raise ConfigError(f"invalid config {chosen}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise ConfigError(f"cannot read config {chosen}: {err.strerror or err}") from None
    return parse_config(data, str(chosen))
