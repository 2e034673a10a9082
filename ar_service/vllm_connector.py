"""KvRelayConnector: kvrelay's vLLM v1 KV connector, the producer side of an AR stage run by vLLM.

vLLM loads it by name from `KVTransferConfig(kv_connector="KvRelayConnector",
kv_connector_module_path="kvrelay.ar_service.vllm_connector", kv_role="kv_producer", ...)`, built
by `kvrelay.ar_service.vllm_engine` from the stage config. One instance per role: the scheduler
side in vLLM's engine core, the worker side in every vLLM worker (one per TP rank).

Owns: keeping a kvrelay request's blocks after vLLM finishes it (`request_finished` returns
`delay_free=True`), reading those blocks out of vLLM's paged cache on each TP rank, packing them in
the destination's page layout and writing them with kvrelay's sender (`write_rank_share`, the same
code as the built-in AR: same staging, outcome, NOT_STARTED/FAILED and checksum rules), and handing
the blocks back to vLLM (`get_finished` -> `finished_sending`) once the rows are copied out of
them for the write (the transport reads only the ticket's staging region, kept while a write is in
doubt) or the ticket is dropped. It never talks to the broker and never decides whether a
write may start: the AR service arms the ticket and sends the write command (through
`collective_rpc`, so every TP rank gets it), and reports the outcomes returned here.

Requests without `kv_transfer_params["kvrelay_ticket"]` are ignored (their blocks free as usual).
An aborted or failed request is never held: its blocks go back at once.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvrelay.ar_service.engine import (
    FinishedWrites,
    WriteDone,
    WriteTicket,
    collect_returned_calls,
    finished_writes,
    write_rank_share,
)
from kvrelay.logging import get_logger
from kvrelay.transfer.staging import StagingAllocator
from kvrelay.transfer.transport import WriteOutcome

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = get_logger(__name__)

TICKET_KEY = "kvrelay_ticket"
ROW_KEY = "kvrelay_row"
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
# How long the connector's shutdown waits for in-doubt transport calls to return.
SHUTDOWN_WAIT_S = 5.0
# (sender, staging, regions) of a shut-down connector whose transport calls still ran: kept
# referenced (never closed nor freed) until the process exits.
_LEFT_RUNNING: list[tuple[Any, Any, Any]] = []


@dataclass(frozen=True, slots=True)
class HeldRow:
    """One CFG row's vLLM request whose blocks the connector holds (vLLM's internal request id)."""

    row: int
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class VllmWriteTicket:
    """The write command every vLLM TP rank gets: the built-in AR's `WriteTicket` plus where each
    row's KV lies in vLLM's cache."""

    write: WriteTicket
    rows: tuple[HeldRow, ...]


@dataclass(frozen=True, slots=True)
class ConnectorDescription:
    rank: int
    pid: int
    transport: str
    session: str
    staging_bytes: int
    num_layers: int
    num_kv_heads_local: int
    head_dim: int
    block_size: int
    dtype: str


class KvRelayConnectorMetadata(KVConnectorMetadata):
    """What travels with each step: the requests the scheduler side began to hold since the last
    step (those of this step's `finished_req_ids` whose blocks wait for `finished_sending`). Write
    commands arrive through `collective_rpc`."""

    def __init__(self, held: frozenset[str] = frozenset()) -> None:
        self.held = held


@dataclass(slots=True)
class _WorkerState:
    kv_caches: list[torch.Tensor] = field(default_factory=list)  # per layer, in layer order
    # Held request ids the scheduler told this worker are finished (get_finished's contract: only
    # those may be returned as finished_sending; any other finished id, an aborted row's, is not
    # kept: it was never returned and piled up here), and those whose blocks this worker no
    # longer reads.
    finished: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)


def check_tls_pair(extra: dict[str, Any]) -> None:
    """Refuse (SecurityError, one line naming the replica, its files and why) a TLS pair the
    connector's PutKv peers would refuse: the key not the certificate's, not signed by
    `tls.ca_file`, expired or not yet valid (kvrelay.server_tls.check_server_pair, as `kvrelay up`,
    `kvrelay ar` and `kvrelay dit` check theirs at start). Checked when vLLM builds the connector,
    before its model loads: otherwise every write failed at its handshake, long after."""
    if str(extra.get("transport", "grpc")) != "grpc":
        return  # Mooncake writes carry no TLS
    from kvrelay.config import SecurityConfig
    from kvrelay.security import BROKER_CALLER_ID, read_tls, tls_files
    from kvrelay.server_tls import check_server_pair

    security_cfg = SecurityConfig.model_validate(extra.get("security") or {})
    name = str(extra.get("replica_id", "")) or BROKER_CALLER_ID
    tls = read_tls(security_cfg, name)
    if tls is not None:
        check_server_pair(tls, f"KvRelayConnector: {name}: {tls_files(security_cfg, name)}")


def unsupported_isa_fix(isa: str) -> str:
    """What to change when vLLM's CPU attention kernel is not the 'vec' one the connector reads
    (vllm.v1.attention.backends.cpu_attn._get_attn_isa picks it)."""
    if isa == "amx":
        return "bfloat16 runs the 'amx' kernel on this CPU: set model.dtype float32 or float16"
    if isa == "vec16":
        # head_dim 80, 112, 160 or 224 (multiples of 16, not of 32), or a block_size not a multiple of 32
        return "vLLM picks 'vec16' for a head_dim or block_size that is not a multiple of 32: such a model is not supported"
    return f"vLLM picks '{isa}' on this CPU architecture (not x86): not supported"


class KvRelayConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        self._extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        check_tls_pair(self._extra)
        # Scheduler side: request id -> block ids of the finished requests we hold, and those held
        # since the last step's metadata.
        self._held: dict[str, tuple[int, ...]] = {}
        self._newly_held: set[str] = set()
        # Worker side.
        self._worker = _WorkerState()
        self._lock = threading.Lock()
        self._staging: torch.Tensor | None = None
        self._regions: StagingAllocator | None = None
        # Final outcomes of in-doubt calls that returned, not collected by the service yet.
        self._finished: list[tuple[str, tuple[WriteOutcome, ...]]] = []
        self._sender: Any = None
        self._session = ""
        self._block_size = int(vllm_config.cache_config.block_size)
        # How long shutdown waits for in-doubt transport calls (below WorkerGroup.stop's 10 s).
        self._shutdown_wait_s = float(self._extra.get("shutdown_wait_s", SHUTDOWN_WAIT_S))

    # ==============================
    # Worker-side methods
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once per worker after vLLM allocated its cache: keep the per-layer tensors (in layer
        order), check that their block layout is one this connector reads, and set up the rank's
        staging buffer and transport endpoint (registered once, fresh ports per process start)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise NotImplementedError(
                "KvRelayConnector reads vLLM's CPU attention block layout only; "
                f"platform {current_platform.device_name!r} is not supported yet (docs/ar.md)"
            )
        ordered: list[tuple[int, torch.Tensor]] = []
        for name, tensor in kv_caches.items():
            match = _LAYER_INDEX.search(f".{name}")
            if match is None:
                raise ValueError(f"KvRelayConnector: cannot tell the layer index of KV cache {name!r}")
            ordered.append((int(match.group(1)), tensor))
        ordered.sort(key=lambda item: item[0])
        if [i for i, _ in ordered] != list(range(len(ordered))):
            raise ValueError(f"KvRelayConnector: KV cache layers {[i for i, _ in ordered]} are not 0..n-1")
        self._check_cpu_isa(ordered[0][1])
        for index, tensor in ordered:
            # CPU_ATTN: [num_blocks, kv_heads, block_size, 2 * head_dim] (see read_row).
            if tensor.dim() != 4 or tensor.shape[2] != self._block_size or not tensor.is_contiguous():
                raise ValueError(
                    f"KvRelayConnector: layer {index} KV cache has shape {tuple(tensor.shape)}, "
                    f"strides {tensor.stride()}; expected contiguous [blocks, heads, {self._block_size}, 2*head_dim]"
                )
        self._worker.kv_caches = [t for _, t in ordered]
        self._start_transport()

    def _check_cpu_isa(self, tensor: torch.Tensor) -> None:
        """The order of K and V inside a CPU block depends on the attention kernel's ISA; read_row
        knows the "vec" one (x86 without AMX, or fp32/fp16 caches), the one validated here."""
        from vllm.v1.attention.backends import cpu_attn

        cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
        head_dim = int(tensor.shape[3]) // 2
        isa = cpu_attn._get_attn_isa(tensor.dtype, self._block_size, head_dim, cache_dtype)
        if isa != "vec":
            raise NotImplementedError(
                f"KvRelayConnector reads vLLM's CPU KV layout of the 'vec' attention kernel; this "
                f"engine uses '{isa}' (dtype {tensor.dtype}, head_dim {head_dim}, block_size "
                f"{self._block_size}, kv_cache_dtype {cache_dtype}): {unsupported_isa_fix(isa)} (docs/ar.md)"
            )

    def _start_transport(self) -> None:
        from kvrelay.transfer.transport import make_sender

        transport = str(self._extra.get("transport", "grpc"))
        staging_bytes = int(self._extra.get("staging_bytes", 64 << 20))
        self._staging = torch.zeros(staging_bytes, dtype=torch.uint8)
        self._regions = StagingAllocator(staging_bytes)
        if transport == "mooncake":
            self._sender = make_sender(
                "mooncake",
                hostname=str(self._extra.get("hostname", "127.0.0.1")),
                protocol=str(self._extra.get("mooncake_protocol", "tcp")),
                device_name=str(self._extra.get("device_name", "")),
            )
            self._sender.register(self._staging)
            self._session = str(self._sender.session_id)
        elif transport == "grpc":
            from kvrelay.config import SecurityConfig
            from kvrelay.security import BROKER_CALLER_ID, load_credentials
            from kvrelay.server_tls import CertificateFiles

            replica_id = str(self._extra.get("replica_id", "")) or None
            security_cfg = SecurityConfig.model_validate(self._extra.get("security") or {})
            creds = load_credentials(security_cfg, replica_id) if replica_id else load_credentials(security_cfg)
            # Its id and TLS only: each write command brings its bearer (Credentials.put_kv_channel).
            security = creds.put_kv_channel(replica_id)
            # A new PutKv channel presents the certificate the replica's files hold then, as the
            # built-in engine's ranks do (kvrelay.server_tls).
            tls_files = None if creds.tls is None else CertificateFiles(security_cfg, replica_id or BROKER_CALLER_ID, creds.tls)
            self._sender = make_sender("grpc", security=security, tls_files=tls_files)
        else:
            raise ValueError(f"KvRelayConnector: transport {transport!r} is not supported")

    def _tp_rank(self) -> int:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    def describe(self) -> ConnectorDescription:
        """What the AR service registers with the broker (called once, through collective_rpc)."""
        first = self._worker.kv_caches[0]
        return ConnectorDescription(
            rank=self._tp_rank(),
            pid=os.getpid(),
            transport=str(self._extra.get("transport", "grpc")),
            session=self._session,
            staging_bytes=0 if self._staging is None else int(self._staging.numel()),
            num_layers=len(self._worker.kv_caches),
            num_kv_heads_local=int(first.shape[1]),
            head_dim=int(first.shape[3]) // 2,
            block_size=self._block_size,
            dtype=str(first.dtype).removeprefix("torch."),
        )

    def read_row(self, row: HeldRow) -> torch.Tensor:
        """This rank's KV of one held row, [num_layers, 2, kv_heads_local, T, head_dim] (K after
        RoPE, as vLLM caches it), copied out of the request's blocks."""
        need = -(-row.num_tokens // self._block_size)
        if len(row.block_ids) < need:
            raise ValueError(
                f"request {row.request_id}: {len(row.block_ids)} blocks for {row.num_tokens} tokens"
            )
        index = torch.tensor(row.block_ids[:need], dtype=torch.long)
        per_layer = []
        for cache in self._worker.kv_caches:
            nb, heads, bs, two_d = cache.shape
            d = two_d // 2
            # One (block, head) of the "vec" layout: K as [head_dim, block_size] (transposed for
            # the kernel's dot products), then V as [block_size, head_dim].
            blocks = cache.view(nb, heads, 2 * bs * d).index_select(0, index)
            k = blocks[..., : bs * d].reshape(need, heads, d, bs).permute(1, 0, 3, 2)
            v = blocks[..., bs * d :].reshape(need, heads, bs, d).permute(1, 0, 2, 3)
            kv = torch.stack((k.reshape(heads, need * bs, d), v.reshape(heads, need * bs, d)))
            per_layer.append(kv[:, :, : row.num_tokens])
        return torch.stack(per_layer)

    def write_ticket(self, command: VllmWriteTicket) -> WriteDone:
        """Copy this rank's share of the ticket out of vLLM's blocks, hand the blocks back, then pack
        and write the copy (`write_rank_share`). Called through collective_rpc on every TP rank,
        between engine steps.

        The blocks go back as soon as `read_row` has copied the rows out (before the transport
        call): the transport reads only the ticket's staging region, which `write_rank_share`
        keeps while a write is IN_DOUBT (until `collect_finished` sees its call return). Holding the
        blocks through an in-doubt call pinned vLLM's cache for nothing, and for good when the
        sender raised (a call nobody sees end)."""
        assert self._staging is not None and self._regions is not None, "register_kv_caches has not run"
        rank = self._tp_rank()
        try:
            kv_by_row = {r.row: self.read_row(r) for r in command.rows}
        except Exception as exc:  # noqa: BLE001 - reported as NOT_STARTED by write_rank_share
            log.error("kvrelay_read_failed", ticket_id=command.write.ticket_id, error=repr(exc))
            kv_by_row = None
        finally:
            # read_row returns copies (index_select, stack): nothing reads these blocks any more.
            self.release([r.request_id for r in command.rows])
        return write_rank_share(
            rank, self._staging, self._sender, kv_by_row, command.write,
            regions=self._regions, reclaim=self._collect_returned,
        )  # fmt: skip

    def _collect_returned(self) -> list[tuple[str, tuple[WriteOutcome, ...]]]:
        """In-doubt calls that returned: their staging regions are freed and their final outcomes
        kept for the service."""
        if self._regions is None:
            return []
        finished = collect_returned_calls(self._sender, self._regions)
        self._finished.extend(finished)
        return finished

    def collect_finished(self) -> FinishedWrites:
        """The service's CollectFinished on this TP rank (through collective_rpc)."""
        assert self._regions is not None, "register_kv_caches has not run"
        self._collect_returned()
        finished, self._finished = self._finished, []
        return finished_writes(self._tp_rank(), finished, self._regions)

    def release(self, request_ids: list[str]) -> None:
        """This worker no longer reads these requests' blocks; get_finished hands them back."""
        with self._lock:
            self._worker.released.update(request_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Called every step: the held requests whose blocks this worker no longer reads (copied
        out for a write, or dropped)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        held = meta.held if isinstance(meta, KvRelayConnectorMetadata) else frozenset()
        with self._lock:
            self._worker.finished.update(finished_req_ids & held)
            done = self._worker.finished & self._worker.released
            self._worker.finished -= done
            self._worker.released -= done
        return (done or None), None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """A producer loads nothing."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """A producer loads nothing."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing is saved during the forward pass: the KV is read once the request finished."""

    def wait_for_save(self) -> None:
        """Nothing is saved during the forward pass."""

    def shutdown(self) -> None:
        """vLLM's worker shutdown (after the last write command answered, between steps). A write
        reported IN_DOUBT may still have its transport call running, reading its staging region:
        wait up to `shutdown_wait_s` for such calls to return (their final outcomes are logged:
        the service, already drained, reports no more), then close the sender. A call still running
        after the bound is left alone: the sender is not closed (Mooncake's close unregisters the
        staging memory, gRPC's waits for the call without a bound) and the staging buffer is kept
        referenced for the process's life, so nothing the call reads is freed; its writes stay
        IN_DOUBT at the broker until this incarnation is proven gone (WRITER_GONE)."""
        sender, self._sender = self._sender, None
        if sender is None:
            return
        def returned(finished: Iterable[tuple[str, tuple[WriteOutcome, ...]]]) -> None:
            # Returned after the service's last CollectFinished: never reported.
            for ticket_id, outcomes in finished:
                log.warning(
                    "kvrelay_in_doubt_write_returned_at_shutdown", ticket_id=ticket_id,
                    statuses=[o.status for o in outcomes],
                )  # fmt: skip

        returned(self._finished)
        self._finished = []
        regions = self._regions
        deadline = time.monotonic() + self._shutdown_wait_s
        while regions is not None:
            returned(collect_returned_calls(sender, regions))
            if not regions.held() or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        left = [] if regions is None else regions.held()
        if left:
            log.error(
                "kvrelay_writes_in_doubt_at_shutdown", tickets=[r.ticket_id for r in left],
                staging_bytes=sum(r.length for r in left), waited_s=self._shutdown_wait_s,
                note="sender left open and staging kept until the process exits; the broker holds their pages until this incarnation is replaced",
            )  # fmt: skip
            _LEFT_RUNNING.append((sender, self._staging, regions))
            return
        sender.close()

    # ==============================
    # Scheduler-side methods
    # ==============================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """A producer has no external tokens to load."""
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        """Nothing to load, so nothing to track after allocation."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        # Built in the same schedule() as scheduler_output.finished_req_ids: the requests held
        # since the last step are among those finished ids.
        meta = KvRelayConnectorMetadata(frozenset(self._newly_held))
        self._newly_held = set()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called once per finished request, before vLLM frees its blocks. A kvrelay row that
        finished normally is held (returns True: this connector now owns freeing its blocks, done
        when every worker reports it in finished_sending); anything else frees at once."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params or {}
        if TICKET_KEY not in params:
            return False, None
        complete = (
            request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
            and request.num_computed_tokens >= request.num_prompt_tokens
        )
        if not complete:
            return False, {TICKET_KEY: params[TICKET_KEY], "kvrelay_held": False}
        held = tuple(int(b) for b in block_ids)
        self._held[request.request_id] = held
        self._newly_held.add(request.request_id)
        return True, {
            TICKET_KEY: params[TICKET_KEY],
            "kvrelay_held": True,
            "kvrelay_request_id": request.request_id,
            "kvrelay_block_ids": list(held),
            "kvrelay_num_tokens": int(request.num_prompt_tokens),
        }

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for request_id in connector_output.finished_sending or ():
            self._held.pop(request_id, None)

    def held_requests(self) -> dict[str, tuple[int, ...]]:
        """Requests whose blocks the scheduler side holds (tests check that nothing leaks)."""
        return dict(self._held)


def describe_worker(worker: Any) -> ConnectorDescription:
    """collective_rpc target: this worker's connector description."""
    return _worker_connector().describe()


def write_on_worker(worker: Any, command: VllmWriteTicket) -> WriteDone:
    """collective_rpc target: this TP rank's share of a ticket's writes."""
    return _worker_connector().write_ticket(command)


def collect_on_worker(worker: Any) -> FinishedWrites:
    """collective_rpc target: in-doubt writes of this TP rank whose calls returned."""
    return _worker_connector().collect_finished()


def release_on_worker(worker: Any, request_ids: list[str]) -> None:
    """collective_rpc target: hand these held requests' blocks back without writing."""
    _worker_connector().release(request_ids)


def read_on_worker(worker: Any, row: HeldRow) -> torch.Tensor:
    """collective_rpc target (tests): this rank's copy of a held row's KV."""
    return _worker_connector().read_row(row).clone()


def _worker_connector() -> KvRelayConnector:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    if not isinstance(connector, KvRelayConnector):
        raise RuntimeError(f"the worker's KV connector is {type(connector).__name__}, not KvRelayConnector")
    return connector


__all__ = ["KvRelayConnector", "HeldRow", "VllmWriteTicket", "ConnectorDescription", "TICKET_KEY", "ROW_KEY"]
