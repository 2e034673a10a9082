"""The AR rank handler: what runs inside each tensor parallel worker process of an AR replica.

Owns, per rank: this rank's shard of the AR model, the KV of every ticket it has prefilled (held
until it is packed; several tickets may share one forward, `PrefillTickets`), one staging buffer
registered once with the rank's transport (Mooncake: one TransferEngine per rank process, fresh
ports per start) split into per-ticket regions (`StagingAllocator`), the packing of a ticket's KV
into its region in the destination page layout, and the writes.

It never talks to the broker and never decides whether a write may start: the service process
arms the ticket and reports the outcomes this handler returns. A write command always answers
with exactly one outcome per write of this rank (it never raises for a transfer failure). An
outcome may be IN_DOUBT (the transport's wait ended while its call still runs): the ticket's
staging region then stays allocated, never repacked, until `CollectFinished` sees the call
return and answers its final outcomes; other tickets pack into the space that is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.logging import get_logger
from kvrelay.security import ChannelSecurity
from kvrelay.server_tls import CertificateFiles
from kvrelay.transfer.layout import KvGeometry
from kvrelay.transfer.planner import PlannedWrite, RowSpec, staging_bytes
from kvrelay.transfer.staging import StagingAllocator, StagingInUse
from kvrelay.transfer.transport import RegionDescriptor, WriteOutcome, not_started_outcomes
from kvrelay.worker import RankContext

log = get_logger(__name__)

# ---------------------------------------------------------------------------------------------
# Commands (sent to every rank in the same order; frozen so they pickle cheaply)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DescribeRank:
    """What the service needs to register the replica: geometry, limits, transport session."""


@dataclass(frozen=True, slots=True)
class RankDescription:
    rank: int
    pid: int
    device: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_tokens: int
    vocab: int
    transport: str
    # Mooncake session "host:rpc_port" of this rank's engine (fresh per process); "" for gRPC.
    session: str
    staging_bytes: int
    # Tokens of several tickets one `PrefillTickets` may carry; 0: the handler prefills one
    # ticket per command (`PrefillTicket` only).
    prefill_batch_tokens: int = 0
    # The KV blocks (of `cache_block_size` tokens) one prefill's rows may hold at once, all of
    # them together (vLLM's whole cache); 0: no such bound (the built-in engine).
    cache_blocks: int = 0
    cache_block_size: int = 0


@dataclass(frozen=True, slots=True)
class PrefillTicket:
    """Prefill every CFG row of a ticket and keep its KV until WriteTicket or DropTicket."""

    ticket_id: str
    rows: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class PrefillDone:
    rank: int
    token_counts: tuple[int, ...]
    kv_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PrefillTickets:
    """Prefill several tickets in one forward (every row of every ticket in one
    `prefill_batch`); each ticket's KV is then held exactly as `PrefillTicket` holds it. Answers
    one `PrefillDone` or `PrefillFailed` per item, in item order: a ticket whose rows are invalid
    fails alone, and a shared forward that raises is retried ticket by ticket (TP=1; with TP > 1
    the command fails whole, as the ranks could not agree on a retry without a collective).
    Sent only to handlers whose `RankDescription.prefill_batch_tokens` > 0 (both engines)."""

    items: tuple[PrefillTicket, ...]


@dataclass(frozen=True, slots=True)
class PrefillFailed:
    """One ticket of a `PrefillTickets` that this rank did not prefill (it holds no KV of it)."""

    rank: int
    ticket_id: str
    message: str


@dataclass(frozen=True, slots=True)
class WriteTicket:
    """Pack and write this rank's share of `plan` (every rank gets the whole plan and keeps the
    writes whose src_rank is its own), then free the ticket's KV."""

    ticket_id: str
    rows: tuple[RowSpec, ...]
    geometry: KvGeometry
    src_shards: int
    dst_shards: int
    plan: tuple[PlannedWrite, ...]
    destinations: tuple[RegionDescriptor, ...]
    timeout_s: float
    # Bound replica tokens: this AR's PutKv credential at the ticket's DiT (the broker's, with
    # Prefill); "" otherwise. Only the gRPC fallback sender presents it.
    write_token: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True)
class WriteDone:
    rank: int
    outcomes: tuple[WriteOutcome, ...]
    packed_bytes: int
    pack_seconds: float
    write_seconds: float
    # How many times this rank's sender has replaced its engine since it started (Mooncake: a
    # peer on a dead one's port, `MooncakeEndpoint._replace_sender`; 0 for other transports).
    # Cumulative, so a lost answer loses nothing: the service counts the increase.
    engine_replacements: int = 0


@dataclass(frozen=True, slots=True)
class DropTicket:
    """Free a ticket's KV without writing (the ticket was never armed, or the request ended)."""

    ticket_id: str


@dataclass(frozen=True, slots=True)
class HeldTickets:
    """The ticket ids whose KV this rank still holds (tests check that nothing leaks)."""


@dataclass(frozen=True, slots=True)
class CollectFinished:
    """Final outcomes of in-doubt writes whose transport calls returned since the last collect;
    their staging regions are freed. Cheap when nothing is in doubt."""


@dataclass(frozen=True, slots=True)
class FinishedWrites:
    rank: int
    # (ticket_id, final outcomes of that ticket's in-doubt writes on this rank)
    finished: tuple[tuple[str, tuple[WriteOutcome, ...]], ...]
    # Tickets whose writes are still in doubt here, and the staging bytes they hold.
    in_doubt_tickets: tuple[str, ...]
    staging_bytes_held: int


# ---------------------------------------------------------------------------------------------
# Rank side
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ArRankSpec:
    """The picklable factory WorkerGroup hands each rank: `spec(ctx) -> ArRankHandler`."""

    preset: str | None
    path: str | None
    weight_seed: int
    dtype: str | None
    transport: str  # "mooncake" | "grpc" | "cuda_ipc"
    hostname: str
    protocol: str = "tcp"
    device_name: str = ""
    staging_bytes: int = 64 << 20
    # "kvrelay" (preset / Llama-family path) or "bagel" / "demo" (a BAGEL-layout directory).
    model_format: str = "kvrelay"
    channel_security: ChannelSecurity | None = None
    # The replica's TLS files: a new PutKv channel presents the pair they hold then.
    tls_files: CertificateFiles | None = None

    def __call__(self, ctx: RankContext) -> ArRankHandler:
        return ArRankHandler(ctx, self)


class ArRankHandler:
    def __init__(self, ctx: RankContext, spec: ArRankSpec) -> None:
        import torch

        from kvrelay.models.ar import build_ar_model
        from kvrelay.transfer.transport import make_sender

        self.ctx = ctx
        self.spec = spec
        if spec.model_format in ("bagel", "demo"):
            from kvrelay.models.bagel import build_ar

            assert spec.path is not None
            self.model: Any = build_ar(spec.path, tp=ctx.tp, device=ctx.device, dtype=spec.dtype)
        else:
            self.model = build_ar_model(
                preset=spec.preset,
                path=spec.path,
                seed=spec.weight_seed,
                tp=ctx.tp,
                device=ctx.device,
                dtype=spec.dtype,
            )
        if hasattr(self.model, "warm_up"):
            self.model.warm_up()  # GPU: compile and capture before the replica reports SERVING
        # KV per ticket, per row: [layers, 2, kv_heads_local, T, head_dim] on the model's device.
        self._held: dict[str, dict[int, Any]] = {}
        # Finished in-doubt calls seen while allocating, kept until the next CollectFinished.
        self._finished: list[tuple[str, tuple[WriteOutcome, ...]]] = []
        pin = ctx.device.startswith("cuda") and torch.cuda.is_available()
        # One staging buffer for the process lifetime, registered once: a transport registration
        # per ticket would cost a round of memory pinning per request. Host memory (pinned on GPU
        # hosts) because the Mooncake TCP transport reads host memory.
        if spec.transport == "cuda_ipc":
            # Same host, GPU to GPU: staging on the device, so packing is a device copy and each
            # write a device-to-device copy into the DiT's mapped pool.
            self.staging = torch.zeros(spec.staging_bytes, dtype=torch.uint8, device=ctx.device)
        else:
            self.staging = torch.zeros(spec.staging_bytes, dtype=torch.uint8, pin_memory=pin)
        # Which bytes of `staging` each ticket's writes read; in-doubt writes keep theirs.
        self.regions = StagingAllocator(spec.staging_bytes)
        if spec.transport == "cuda_ipc":
            self.sender = make_sender("cuda_ipc", device=ctx.device)
            self.session = ""
        elif spec.transport == "mooncake":
            self.sender = make_sender(
                "mooncake", hostname=spec.hostname, protocol=spec.protocol, device_name=spec.device_name
            )
            self.sender.register(self.staging)  # type: ignore[attr-defined]
            self.session = str(self.sender.session_id)  # type: ignore[attr-defined]
        elif spec.transport == "grpc":
            self.sender = make_sender("grpc", security=spec.channel_security, tls_files=spec.tls_files)
            self.session = ""
        else:
            raise ValueError(f"transport {spec.transport!r} is not supported by the AR service")

    # -- dispatch --------------------------------------------------------------------------------

    def handle(self, command: Any) -> Any:
        if isinstance(command, PrefillTicket):
            return self._prefill(command)
        if isinstance(command, PrefillTickets):
            return self._prefill_tickets(command)
        if isinstance(command, WriteTicket):
            return self._write(command)
        if isinstance(command, DropTicket):
            self._held.pop(command.ticket_id, None)
            return None
        if isinstance(command, DescribeRank):
            return self._describe()
        if isinstance(command, HeldTickets):
            return sorted(self._held)
        if isinstance(command, CollectFinished):
            return self._collect_finished()
        raise TypeError(f"unknown AR rank command {type(command).__name__}")

    def _describe(self) -> RankDescription:
        from kvrelay.models.ar import PACK_TOKENS

        cfg = self.model.config
        dtype = str(self.model.dtype).removeprefix("torch.")
        return RankDescription(
            rank=self.ctx.rank,
            pid=os.getpid(),
            device=self.ctx.device,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
            max_tokens=cfg.max_tokens,
            vocab=cfg.vocab,
            transport=self.spec.transport,
            session=self.session,
            staging_bytes=int(self.staging.numel()),
            # Four full packs: enough to share a forward between a few tickets, small enough
            # that one batch never holds the ranks much longer than one long ticket does.
            prefill_batch_tokens=4 * PACK_TOKENS,
        )

    # -- prefill ---------------------------------------------------------------------------------

    def _prefill(self, cmd: PrefillTicket) -> PrefillDone:
        return self._prefill_together([cmd])[0]

    def _prefill_tickets(self, cmd: PrefillTickets) -> tuple[PrefillDone | PrefillFailed, ...]:
        cfg = self.model.config
        return prefill_tickets(
            cmd, self.ctx, drop=lambda t: self._held.pop(t, None),
            row_problem=lambda rows: row_problem(rows, cfg.max_tokens, cfg.vocab), together=self._prefill_together,
        )  # fmt: skip

    def _prefill_together(self, items: Sequence[PrefillTicket]) -> list[PrefillDone]:
        """Every row of `items` in one forward; each ticket's KV held as its own. Each ticket's
        `seconds` is the shared forward's time."""
        # Drop any earlier KV of these tickets first: a retried prefill must not double the memory.
        for item in items:
            self._held.pop(item.ticket_id, None)
        rows = [list(ids) for item in items for ids in item.rows]
        start = time.perf_counter()
        if hasattr(self.model, "prefill_batch"):
            # All CFG rows of all tickets in one batched forward (packed, a captured graph on a GPU).
            kvs = list(self.model.prefill_batch(rows))
        else:
            kvs = [self.model.prefill(ids) for ids in rows]
        if self.model.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.model.device)
        seconds = time.perf_counter() - start
        done = []
        first = 0
        for item in items:
            kv_by_row = dict(enumerate(kvs[first : first + len(item.rows)]))
            first += len(item.rows)
            self._held[item.ticket_id] = kv_by_row
            kv_bytes = sum(int(kv.numel()) * kv.element_size() for kv in kv_by_row.values())
            done.append(PrefillDone(self.ctx.rank, tuple(len(ids) for ids in item.rows), kv_bytes, seconds))
        return done

    # -- write -----------------------------------------------------------------------------------

    def _write(self, cmd: WriteTicket) -> WriteDone:
        try:
            return write_rank_share(
                self.ctx.rank, self.staging, self.sender, self._held.get(cmd.ticket_id), cmd,
                # The KV is in staging now; the model-side tensors are no longer needed.
                on_packed=lambda: self._held.pop(cmd.ticket_id, None),
                regions=self.regions, reclaim=self._collect_finished_now,
            )  # fmt: skip
        finally:
            # Packed or never to be packed: the source KV can go.
            self._held.pop(cmd.ticket_id, None)

    def _collect_finished_now(self) -> list[tuple[str, tuple[WriteOutcome, ...]]]:
        finished = collect_returned_calls(self.sender, self.regions)
        self._finished.extend(finished)
        return finished

    def _collect_finished(self) -> FinishedWrites:
        self._collect_finished_now()
        finished, self._finished = self._finished, []
        return finished_writes(self.ctx.rank, finished, self.regions)

    def close(self) -> None:
        self._held.clear()
        # Closing the sender waits for its write threads and unregisters staging; it runs only
        # after the last write command answered, so no transfer still reads this memory.
        self.sender.close()


def prefill_tickets(
    cmd: PrefillTickets,
    ctx: RankContext,
    *,
    drop: Callable[[str], object],
    row_problem: Callable[[tuple[tuple[int, ...], ...]], str | None],
    together: Callable[[Sequence[PrefillTicket]], Sequence[PrefillDone | PrefillFailed]],
) -> tuple[PrefillDone | PrefillFailed, ...]:
    """A rank handler's answer to `PrefillTickets` (both engines): the invalid tickets fail alone,
    the others go through `together` (one shared prefill, one result per ticket); when that
    raises, each is retried alone with one rank (with several, the command fails whole).
    `drop(ticket_id)` frees any KV a rank holds of a ticket."""
    results: list[PrefillDone | PrefillFailed | None] = [None] * len(cmd.items)
    valid: list[int] = []
    seen: set[str] = set()
    for i, item in enumerate(cmd.items):
        # Checked before the shared prefill, the same way on every rank (a pure check of the
        # ids), so a bad ticket fails alone and the ranks still run the same collectives.
        drop(item.ticket_id)
        problem = "appears twice in one PrefillTickets" if item.ticket_id in seen else row_problem(item.rows)
        seen.add(item.ticket_id)
        if problem is None:
            valid.append(i)
        else:
            results[i] = PrefillFailed(ctx.rank, item.ticket_id, problem)
    if valid:
        done: Sequence[PrefillDone | PrefillFailed]
        try:
            done = together([cmd.items[i] for i in valid])
        except Exception as exc:
            if ctx.world_size > 1:
                # A rank that failed alone would pair its retry's all-reduces with its peers'
                # pending ones: fail the command; the service retries ticket by ticket.
                raise
            log.warning("prefill_batch_failed", tickets=len(valid), error=repr(exc))
            done = [_prefill_alone(ctx, cmd.items[i], drop, together) for i in valid]
        for i, result in zip(valid, done, strict=True):
            results[i] = result
    assert all(r is not None for r in results)
    return tuple(r for r in results if r is not None)


def _prefill_alone(
    ctx: RankContext,
    item: PrefillTicket,
    drop: Callable[[str], object],
    together: Callable[[Sequence[PrefillTicket]], Sequence[PrefillDone | PrefillFailed]],
) -> PrefillDone | PrefillFailed:
    try:
        return together([item])[0]
    except Exception as exc:  # noqa: BLE001 - this ticket's outcome, not the command's
        drop(item.ticket_id)
        return PrefillFailed(ctx.rank, item.ticket_id, f"{type(exc).__name__}: {exc}")


def row_problem(rows: tuple[tuple[int, ...], ...], max_tokens: int, vocab: int) -> str | None:
    """Why `rows` cannot be prefilled by a model of `max_tokens` and `vocab` (what the model's
    own checks would raise), or None."""
    if not rows:
        return "no rows"
    for row, ids in enumerate(rows):
        if not ids:
            return f"row {row} has no tokens"
        if len(ids) > max_tokens:
            return f"row {row} has {len(ids)} tokens; the model's max is {max_tokens}"
        if min(ids) < 0 or max(ids) >= vocab:
            return f"row {row}: token ids must be in [0, {vocab}), got [{min(ids)}, {max(ids)}]"
    return None


def collect_returned_calls(sender: Any, regions: StagingAllocator) -> list[tuple[str, tuple[WriteOutcome, ...]]]:
    """The in-doubt write calls of `sender` that have really returned since the last collect, as
    (ticket_id, final outcomes); their staging regions are freed (nothing reads them any more).
    Shared by the built-in rank handler and vLLM's KvRelayConnector."""
    collect = getattr(sender, "collect_finished", None)  # transports that never doubt lack it
    finished = []
    for call in collect() if collect is not None else ():
        regions.end_read(call.ticket_id)
        regions.free(call.ticket_id)
        finished.append((call.ticket_id, call.outcomes))
    return finished


def finished_writes(
    rank: int, finished: Sequence[tuple[str, tuple[WriteOutcome, ...]]], regions: StagingAllocator
) -> FinishedWrites:
    held = regions.held()
    return FinishedWrites(rank, tuple(finished), tuple(r.ticket_id for r in held), sum(r.length for r in held))


def write_rank_share(
    rank: int,
    staging: Any,
    sender: Any,
    kv_by_row: Mapping[int, Any] | None,
    cmd: WriteTicket,
    on_packed: Callable[[], object] | None = None,
    regions: StagingAllocator | None = None,
    reclaim: Callable[[], object] | None = None,
) -> WriteDone:
    """Pack `rank`'s writes of `cmd.plan` from `kv_by_row` (row -> [layers, 2, kv_heads_local, T,
    head_dim]) into `staging` and send them with `sender`: exactly one outcome per write of this
    rank, never an exception for a transfer failure. Shared by the built-in rank handler and
    vLLM's KvRelayConnector (the same pack, outcome and NOT_STARTED/FAILED rules for both).
    `on_packed` runs once the KV is in staging (the source KV is no longer read after that).

    With `regions`, the ticket packs into its own region of `staging` and keeps it while any write
    is IN_DOUBT (the caller frees it when `sender.collect_finished()` returns the call); `reclaim`
    is asked to do that when no gap is large enough. Without it the caller owns `staging` whole.

    The answer carries the sender's engine replacements so far (`WriteDone.engine_replacements`)."""
    done = _write_rank_share(rank, staging, sender, kv_by_row, cmd, on_packed, regions, reclaim)
    return dataclasses.replace(done, engine_replacements=int(getattr(sender, "engine_replacements", 0)))


def _write_rank_share(
    rank: int,
    staging: Any,
    sender: Any,
    kv_by_row: Mapping[int, Any] | None,
    cmd: WriteTicket,
    on_packed: Callable[[], object] | None,
    regions: StagingAllocator | None,
    reclaim: Callable[[], object] | None,
) -> WriteDone:
    """The body of `write_rank_share`, which adds the engine replacements."""
    from kvrelay.transfer.pack import pack_staging

    mine = [w for w in cmd.plan if w.src_rank == rank]
    if not mine:
        return WriteDone(rank, (), 0, 0.0, 0.0)
    if kv_by_row is None:
        outcomes = not_started_outcomes(mine, f"rank {rank} holds no KV for ticket {cmd.ticket_id}")
        return WriteDone(rank, tuple(outcomes), 0, 0.0, 0.0)
    need = staging_bytes(cmd.plan, rank)
    if need > staging.numel():
        outcomes = not_started_outcomes(
            mine,
            f"rank {rank} needs {need} staging bytes, has {staging.numel()}: "
            "raise the AR stage's kv_cache_memory_bytes",
        )
        return WriteDone(rank, tuple(outcomes), 0, 0.0, 0.0)
    t0 = time.perf_counter()
    # Until `sender.write` is called nothing has left this rank: any error is NOT_STARTED, as an
    # outcome (an exception would leave the service unable to tell, and it must then hold the
    # pages IN_DOUBT until this incarnation is gone).
    allocated = reading = False
    try:
        view = staging
        if regions is not None:
            region = regions.allocate(cmd.ticket_id, need)
            if region is None and reclaim is not None:
                # Space held by in-doubt writes of earlier tickets: take back what has returned.
                reclaim()
                region = regions.allocate(cmd.ticket_id, need)
            if region is None:
                held = ", ".join(f"{r.ticket_id}:{r.length}" for r in regions.held())
                outcomes = not_started_outcomes(
                    mine, f"rank {rank}: no {need} free staging bytes; in-doubt writes still read [{held}]"
                )
                return WriteDone(rank, tuple(outcomes), 0, 0.0, 0.0)
            allocated = True
            regions.check_writable(cmd.ticket_id)
            view = staging[region.offset : region.offset + need]
        t0 = time.perf_counter()
        packed = pack_staging(
            view, kv_by_row, cmd.geometry, cmd.src_shards, cmd.dst_shards, cmd.rows, cmd.plan, rank
        )
        t1 = time.perf_counter()
        if on_packed is not None:
            on_packed()
        destinations = {d.rank: d for d in cmd.destinations}
        if regions is not None:
            regions.begin_read(cmd.ticket_id)
            reading = True
    except StagingInUse:
        raise  # a broken staging invariant (an assertion), not a write failure
    except Exception as exc:  # noqa: BLE001 - nothing was sent: every write is NOT_STARTED
        # Hand back only what this call took: a region of an earlier in-doubt call is not ours.
        if regions is not None and allocated:
            with contextlib.suppress(Exception):
                if reading:
                    regions.end_read(cmd.ticket_id)
                regions.free(cmd.ticket_id)
        outcomes = not_started_outcomes(mine, f"rank {rank} failed before sending: {exc!r}")
        return WriteDone(rank, tuple(outcomes), 0, time.perf_counter() - t0, 0.0)
    try:
        token = {"write_token": cmd.write_token} if cmd.write_token else {}
        outcomes = list(sender.write(view, mine, destinations, cmd.ticket_id, cmd.timeout_s, **token))
    except ValueError as exc:
        # The senders validate everything before the first byte leaves (their contract).
        outcomes = not_started_outcomes(mine, f"write refused before sending: {exc}")
    except Exception as exc:  # noqa: BLE001 - unknown how far it got: the bytes may land
        # Nobody will see this call end: in doubt for good; its region stays held (never
        # repacked) and its pages drain until this incarnation is replaced.
        outcomes = [
            WriteOutcome(w.row, w.src_rank, w.dst_rank, "IN_DOUBT", w.num_bytes, 0, f"sender raised: {exc!r}")
            for w in mine
        ]
    if regions is not None and all(o.final for o in outcomes):
        # The transport call returned: nothing reads the region any more. A failure to hand it
        # back leaves it held (safe: only space is lost); the outcomes stand either way.
        try:
            regions.end_read(cmd.ticket_id)
            regions.free(cmd.ticket_id)
        except Exception:  # noqa: BLE001
            pass
    return WriteDone(rank, tuple(outcomes), packed, t1 - t0, time.perf_counter() - t1)


def rank_share(plan: Sequence[PlannedWrite], rank: int) -> list[PlannedWrite]:
    return [w for w in plan if w.src_rank == rank]


# ---------------------------------------------------------------------------------------------
# Measurement: `python -m kvrelay.ar_service.engine --preset small --tokens 256 --tp 1`
# ---------------------------------------------------------------------------------------------


def _measure(argv: Sequence[str] | None = None) -> None:
    """Prefill tokens/s on rank workers exactly as the service runs them (same handler, same
    thread share per rank), for docs/ar.md."""
    import argparse
    import statistics

    from kvrelay.worker import WorkerGroup

    parser = argparse.ArgumentParser(prog="python -m kvrelay.ar_service.engine")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", default="cpu", help="cpu, or one CUDA index per rank: 0,1")
    args = parser.parse_args(argv)
    devices = ["cpu"] * args.tp if args.devices == "cpu" else [f"cuda:{d}" for d in args.devices.split(",")]
    spec = ArRankSpec(
        preset=args.preset, path=None, weight_seed=0, dtype=None, transport="grpc", hostname="127.0.0.1"
    )
    with WorkerGroup(args.tp, spec, devices=devices, name="kvrelay-ar-measure") as group:
        threads = group.threads_per_rank
        for n in args.tokens:
            ids = tuple([256] + [97 + i % 26 for i in range(n - 1)])
            group.call_all(PrefillTicket("warmup", (ids,)))
            times = []
            for _ in range(args.repeats):
                done = group.call_all(PrefillTicket("measure", (ids,)))
                times.append(max(d.seconds for d in done))
            group.call_all(DropTicket("measure"))
            group.call_all(DropTicket("warmup"))
            median = statistics.median(times)
            print(
                f"preset={args.preset} tp={args.tp} devices={args.devices} threads/rank={threads} tokens={n} "
                f"prefill_ms={median * 1000:.1f} tokens_per_s={n / median:.0f}",
                flush=True,
            )


if __name__ == "__main__":
    _measure()
