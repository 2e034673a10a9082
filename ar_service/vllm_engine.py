"""The AR stage run by vLLM (`model: {engine: vllm, path: DIR}`): engine arguments, the
KVTransferConfig kvrelay builds for its `KvRelayConnector`, and the rank handler that hosts the
engine.

The handler answers the same commands as the built-in AR's rank handler (engine.py:
`DescribeRank`, `PrefillTicket`, `PrefillTickets`, `WriteTicket`, `DropTicket`, `HeldTickets`), so the AR service
(Prefill protocol, arming, reports, ledger) is the same code for both engines. It runs in one
kvrelay worker process (spawned, dies with the service) that hosts vLLM's engine in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the handler drives the engine's steps itself, so a held
request's blocks go back to vLLM at the step right after its write command copied them out. vLLM's own TP workers
(tensor_parallel_size > 1) are vLLM's processes; every command reaches all of them through
`collective_rpc`.

Prefill runs each CFG row as one vLLM request with `max_tokens=1` whose KV the connector keeps
when the request finishes; a `PrefillTickets` adds every row of its tickets and steps them together
(one scheduling pass shared by the tickets). Settings that would break that hand-off are refused at start with the
setting named (REFUSED_ARGS); chunked prefill is allowed (the blocks are read only after the
whole prompt is computed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.ar_service.engine import (
    CollectFinished,
    DescribeRank,
    DropTicket,
    FinishedWrites,
    HeldTickets,
    PrefillDone,
    PrefillFailed,
    PrefillTicket,
    PrefillTickets,
    RankDescription,
    WriteDone,
    WriteTicket,
    prefill_tickets,
    row_problem,
)
from kvrelay.ar_service.vllm_tokenizer import (
    PROBE_TEXTS,
    BackendTokenizer,
    DescribeTokenizer,
    EngineTokenizer,
    torch_free_problem,
)
from kvrelay.config import (
    VLLM_KVCACHE_DEFAULT_GIB,
    VLLM_KVCACHE_ENV,
    ConfigError,
    StageConfig,
    check_vllm_kvcache_space,
)
from kvrelay.logging import get_logger
from kvrelay.models.formats import HF_TOKENIZER_FILES, ar_dtype, check_tokenizer_files
from kvrelay.worker import RankContext

log = get_logger(__name__)

CONNECTOR_NAME = "KvRelayConnector"
CONNECTOR_MODULE = "kvrelay.ar_service.vllm_connector"
INSTALL_HINT = (
    "engine: vllm needs vLLM: run scripts/setup.sh --vllm (or pip install 'kvrelay[vllm]'), see docs/ar.md"
)

# vLLM settings that would break the hand-off of a request's blocks, refused at start.
REFUSED_ARGS: dict[str, str] = {
    "enable_prefix_caching": "prefix caching shares cached blocks between requests, so a held "
    "request's blocks could be another request's prefix; kvrelay turns it off",
    "speculative_config": "speculative decoding is not supported with KvRelayConnector",
    "enable_sleep_mode": "sleep mode unmaps the KV cache that held requests are written from",
    "kv_transfer_config": "kvrelay builds the KVTransferConfig itself (KvRelayConnector)",
    "model": "set model.path instead",
    "tensor_parallel_size": "set the stage's tensor_parallel_size instead",
    "max_num_seqs": "set the stage's max_num_seqs instead",
    "dtype": "set model.dtype instead",
    "tokenizer": "set model.tokenizer instead",
}
# Allowed only at these values: anything else makes vLLM's cache another dtype than the model's
# (fp8), which the DiT attending over the KV cannot read.
_ONLY: dict[str, tuple[Any, ...]] = {"kv_cache_dtype": ("auto",)}
# Test-only fault hook (tests/vllm): comma-separated token ids; a PrefillTicket with a row that
# contains them makes the prefill that carries it raise mid-pass (after a step that ended a row),
# as a model error would. Read once when the engine starts; unset in production.
PREFILL_FAULT_ENV = "KVRELAY_TEST_VLLM_PREFILL_FAULT"

# Allowed but pinned to what the hand-off needs.
_MUST_BE: dict[str, Any] = {"pipeline_parallel_size": 1, "data_parallel_size": 1}


def _whole_bytes(value: Any) -> bool:
    """A byte count vLLM's EngineArgs take: an int >= 1, or its decimal digits."""
    if isinstance(value, str) and value.isascii() and value.strip().isdigit():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_vllm_args(args: dict[str, Any]) -> None:
    """Refuse the vLLM settings kvrelay cannot honour, naming the setting (ConfigError)."""
    for key, value in args.items():
        if key in REFUSED_ARGS and not (key == "enable_prefix_caching" and value is False):
            raise ConfigError(f"stages[0].model.vllm_args.{key}: {REFUSED_ARGS[key]}")
        if key in _ONLY and value not in _ONLY[key]:
            raise ConfigError(
                f"stages[0].model.vllm_args.{key}: {value!r} is not supported with KvRelayConnector (only "
                f"{', '.join(map(repr, _ONLY[key]))}): the DiT reads the AR's KV in the model's dtype (model.dtype)"
            )
        if key == "kv_cache_memory_bytes" and not _whole_bytes(value):
            # vLLM's CLI reads "512M"; its EngineArgs, which kvrelay hands these, take bytes only
            # (refused ~20 s into vLLM's start), and 0 failed later, as no cache at all.
            raise ConfigError(
                f"stages[0].model.vllm_args.kv_cache_memory_bytes: {value!r}: vLLM's KV cache size in bytes, "
                "a whole number >= 1 (e.g. 536870912 for 512 MiB)"
            )
        if key in _MUST_BE and value != _MUST_BE[key]:
            raise ConfigError(
                f"stages[0].model.vllm_args.{key}: must be {_MUST_BE[key]} with KvRelayConnector"
            )


def kv_transfer_config(stage: StageConfig) -> dict[str, Any]:
    """The stage's transfer config as vLLM KVTransferConfig fields for kvrelay's connector (never
    vLLM's own MooncakeConnector): the transport and its options travel in the extra config."""
    extra: dict[str, Any] = {
        "transport": stage.transport,
        "hostname": stage.advertise_host,
        "mooncake_protocol": stage.mooncake_protocol,
        "device_name": str(stage.extra.get("device_name", "")),
        # The stage's per-worker memory budget is each vLLM worker's staging buffer.
        "staging_bytes": stage.kv_cache_memory_bytes,
    }
    engine_id = stage.kv_transfer_config.engine_id if stage.kv_transfer_config else None
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "engine_id": engine_id or "ar",
        "kv_connector_extra_config": extra,
    }


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Asked by tests: what the engine still holds."""


@dataclass(frozen=True, slots=True)
class EngineStatsReply:
    held_request_ids: tuple[str, ...]  # requests whose blocks the connector holds
    held_tickets: tuple[str, ...]
    free_blocks: int
    total_blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class ReadHeld:
    """Asked by tests: vLLM's cache content of a held ticket's rows, per TP rank."""

    ticket_id: str


@dataclass(frozen=True, slots=True)
class OnWorkers:
    """Run `fn(worker, *args)` on every vLLM worker (collective_rpc) and return the results; tests
    reach the connector this way (e.g. to hold its transport calls)."""

    fn: Any
    args: tuple[Any, ...] = ()



@dataclass(frozen=True, slots=True)
class VllmRankSpec:
    """The picklable factory WorkerGroup hands its one process: `spec(ctx) -> VllmRankHandler`."""

    path: str
    tokenizer: str | None
    dtype: str | None
    tensor_parallel_size: int
    max_num_seqs: int
    transfer: dict[str, Any]
    vllm_args: dict[str, Any] = field(default_factory=dict)
    prefill_timeout_s: float = 300.0

    def __call__(self, ctx: RankContext) -> VllmRankHandler:
        return VllmRankHandler(ctx, self)

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.path,
            "tokenizer": self.tokenizer or self.path,
            "dtype": self.dtype or "auto",
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": False,
            "gpu_memory_utilization": 0.3,
            # Engine start in seconds rather than minutes; override with vllm_args.enforce_eager: false.
            "enforce_eager": True,
            "seed": 0,
        }
        kwargs.update(self.vllm_args)
        return kwargs


def vllm_rank_spec(stage: StageConfig) -> VllmRankSpec:
    """The rank spec of an `engine: vllm` AR stage; ConfigError names a refused setting."""
    model = stage.model
    assert model.path is not None  # the config requires it with engine: vllm
    if not (Path(model.path) / "config.json").is_file():
        raise ConfigError(f"stages[0].model.path: {model.path!r} is not a model directory (no config.json)")
    check_vllm_args(model.vllm_args)
    if stage.tensor_parallel_size != 1:
        # The connector reads each vLLM TP rank's own heads (src_rank = vLLM's TP rank), but vLLM's
        # TP workers would be children of kvrelay's (daemonic) engine process, which Python forbids.
        raise ConfigError(
            "stages[0].tensor_parallel_size: engine: vllm runs with tensor_parallel_size 1 in this build"
        )
    if model.tokenizer is None and not any((Path(model.path) / name).is_file() for name in HF_TOKENIZER_FILES):
        # vLLM's own error comes after its ~20 s start, over several lines, without the fix.
        raise ConfigError(
            f"stages[0].model.path: {model.path!r} has no tokenizer (none of {', '.join(HF_TOKENIZER_FILES)}): "
            "copy the checkpoint's tokenizer files there or set model.tokenizer"
        )
    return VllmRankSpec(
        path=model.path,
        tokenizer=model.tokenizer,
        # The built-in engine's default, not vLLM's `auto` (bfloat16 for a float32 checkpoint on
        # CPUs that have it): the DiT's dtype is checked against this one when the config loads.
        dtype=ar_dtype(model, on_cpu=stage.device_list() == ["cpu"]),
        tensor_parallel_size=stage.tensor_parallel_size,
        max_num_seqs=stage.max_num_seqs,
        transfer=kv_transfer_config(stage),
        vllm_args=dict(model.vllm_args),
    )


def engine_env(vllm_args: dict[str, Any] | None = None) -> dict[str, str]:
    """Environment of the process that hosts vLLM (set before vLLM is imported), for a stage with
    these `vllm_args`. `VLLM_CPU_KVCACHE_SPACE` goes to vLLM checked (ConfigError: vLLM reads it
    with int() deep in its start) and normalised; kvrelay's default (1 GiB) when unset or empty,
    none at all when `vllm_args.kv_cache_memory_bytes` sizes the cache (vLLM lets the variable
    override it)."""
    args = vllm_args or {}
    try:
        space = check_vllm_kvcache_space(os.environ, args)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    env = {
        # The engine core runs in the handler's process: the handler drives its steps.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
    }
    if "kv_cache_memory_bytes" not in args:
        env[VLLM_KVCACHE_ENV] = str(space if space is not None else VLLM_KVCACHE_DEFAULT_GIB)
    return env


class VllmStartError(RuntimeError):
    """vLLM could not start; the message says what and how to fix it."""


# vLLM's start failure when its KV cache cannot hold one max_model_len request; on CPU it tells to
# raise gpu_memory_utilization, which does nothing where the cache size is set explicitly (kvrelay
# always sets one: VLLM_CPU_KVCACHE_SPACE or vllm_args.kv_cache_memory_bytes).
_CACHE_TOO_SMALL = "To serve at least one request with the model's max seq len"


def start_failure(path: str, exc: BaseException) -> str:
    """vLLM's start failure on one line: the node prints the first line of a child's error, and
    some of vLLM's (transformers' tokenizer error) put their reason on the following lines."""
    reason = f"{type(exc).__name__}: {exc}"
    if _CACHE_TOO_SMALL in str(exc):
        # Ahead of vLLM's reason: the node shows the start of a long line.
        reason = (
            "vLLM's KV cache cannot hold one request of max_model_len tokens: on CPU its size is "
            f"{VLLM_KVCACHE_ENV} (GiB, kvrelay's default {VLLM_KVCACHE_DEFAULT_GIB}) or "
            "stages[0].model.vllm_args.kv_cache_memory_bytes, not gpu_memory_utilization: raise it or "
            f"lower vllm_args.max_model_len ({reason})"
        )
    return " ".join(f"vLLM failed to start for {path}: {reason}".split())


class VllmCacheFull(RuntimeError):
    """The rows of a prefill need more of vLLM's KV blocks than are free now: vLLM would keep the
    rows it cannot place waiting (the held ones never give theirs back during the pass) until the
    prefill timeout, holding the AR. Raised before anything is added to vLLM."""


class InjectedPrefillFault(RuntimeError):
    """Raised mid-prefill by the test-only fault hook (PREFILL_FAULT_ENV)."""


def _fault_tokens() -> tuple[int, ...]:
    text = os.environ.get(PREFILL_FAULT_ENV, "").strip()
    return tuple(int(t) for t in text.split(",")) if text else ()


def _contains(ids: Sequence[int], needle: tuple[int, ...]) -> bool:
    n = len(needle)
    return any(tuple(ids[i : i + n]) == needle for i in range(len(ids) - n + 1))


class VllmRankHandler:
    def __init__(self, ctx: RankContext, spec: VllmRankSpec) -> None:
        self.ctx = ctx
        self.spec = spec
        env = engine_env(spec.vllm_args)
        for key, value in env.items():
            os.environ.setdefault(key, value)
        # Checked and normalised (" 2 " -> "2"); gone when vllm_args.kv_cache_memory_bytes sizes
        # the cache (an empty one inherited would override it, or fail vLLM's int()).
        os.environ.pop(VLLM_KVCACHE_ENV, None)
        if VLLM_KVCACHE_ENV in env:
            os.environ[VLLM_KVCACHE_ENV] = env[VLLM_KVCACHE_ENV]
        try:
            from vllm import LLMEngine
            from vllm.config import KVTransferConfig
            from vllm.engine.arg_utils import EngineArgs
        except ImportError as exc:
            raise VllmStartError(f"{INSTALL_HINT} ({exc})") from exc
        try:
            args = EngineArgs(**spec.engine_kwargs(), kv_transfer_config=KVTransferConfig(**spec.transfer))
        except TypeError as exc:
            raise VllmStartError(f"stages[0].model.vllm_args: {exc}") from exc
        started = time.perf_counter()
        try:
            self.engine = LLMEngine.from_engine_args(args)
        except Exception as exc:
            raise VllmStartError(start_failure(spec.path, exc)) from exc
        model_config = self.engine.vllm_config.model_config
        # vLLM refuses a prompt of max_model_len tokens: the one sampled token must fit too.
        self.max_tokens = int(model_config.max_model_len) - 1
        # The tokens one scheduling step computes: the tickets of one PrefillTickets up to this
        # share a step's forward (rows permitting, max_num_seqs); more would only queue behind it
        # and hold every ticket of the batch until the last one is done. The oldest waiting ticket
        # always goes, however long (chunked prefill spreads it over several steps).
        self.batch_tokens = int(self.engine.vllm_config.scheduler_config.max_num_batched_tokens)
        self.vocab = int(model_config.get_vocab_size())
        self.block_size = int(self.engine.vllm_config.cache_config.block_size)
        # ticket -> its rows as the connector holds them
        self._held: dict[str, tuple[Any, ...]] = {}
        self._descriptions = self.engine.collective_rpc(_describe)
        self._fault_tokens = _fault_tokens()
        if self._fault_tokens:
            log.warning(
                "vllm_prefill_fault_hook_armed", env=PREFILL_FAULT_ENV, tokens=list(self._fault_tokens)
            )
        log.info(
            "vllm_engine_started",
            path=spec.path,
            seconds=round(time.perf_counter() - started, 1),
            tp=spec.tensor_parallel_size,
            block_size=self.block_size,
            blocks=self._scheduler().kv_cache_manager.block_pool.num_gpu_blocks,
        )

    # -- dispatch --------------------------------------------------------------------------------

    def handle(self, command: Any) -> Any:
        if isinstance(command, PrefillTicket):
            return self._prefill(command)
        if isinstance(command, PrefillTickets):
            return self._prefill_tickets(command)
        if isinstance(command, WriteTicket):
            return self._write(command)
        if isinstance(command, DropTicket):
            self._drop(command.ticket_id)
            return None
        if isinstance(command, DescribeRank):
            return self._describe()
        if isinstance(command, DescribeTokenizer):
            try:
                tok = self.engine.get_tokenizer()
            except Exception as exc:  # vllm_args.skip_tokenizer_init: vLLM loaded none
                return EngineTokenizer("", 0, None, None, (), None, f"vLLM has no tokenizer ({exc})")
            return describe_engine_tokenizer(tok)
        if isinstance(command, HeldTickets):
            return sorted(self._held)
        if isinstance(command, CollectFinished):
            return self._collect_finished()
        if isinstance(command, EngineStats):
            return self._stats()
        if isinstance(command, OnWorkers):
            return self.engine.collective_rpc(command.fn, args=command.args)
        if isinstance(command, ReadHeld):
            from kvrelay.ar_service.vllm_connector import read_on_worker

            rows = self._held[command.ticket_id]
            return [self.engine.collective_rpc(read_on_worker, args=(row,)) for row in rows]
        raise TypeError(f"unknown AR rank command {type(command).__name__}")

    def _scheduler(self) -> Any:
        # In-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): LLMEngine -> InprocClient -> EngineCore.
        return self.engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]

    def _describe(self) -> RankDescription:
        first = self._descriptions[0]
        return RankDescription(
            rank=self.ctx.rank,
            pid=os.getpid(),
            device=self.ctx.device,
            num_layers=first.num_layers,
            num_kv_heads=first.num_kv_heads_local * self.spec.tensor_parallel_size,
            head_dim=first.head_dim,
            dtype=first.dtype,
            max_tokens=self.max_tokens,
            vocab=self.vocab,
            transport=first.transport,
            session=",".join(d.session for d in self._descriptions),
            staging_bytes=first.staging_bytes,
            prefill_batch_tokens=self.batch_tokens,
            cache_blocks=self._stats().total_blocks,
            cache_block_size=self.block_size,
        )

    def _stats(self) -> EngineStatsReply:
        scheduler = self._scheduler()
        pool = scheduler.kv_cache_manager.block_pool
        return EngineStatsReply(
            held_request_ids=tuple(sorted(scheduler.connector.held_requests())),
            held_tickets=tuple(sorted(self._held)),
            free_blocks=int(pool.get_num_free_blocks()),
            # Block 0 is vLLM's null block: never free, never handed out.
            total_blocks=int(pool.num_gpu_blocks) - 1,
            block_size=self.block_size,
        )

    # -- prefill ---------------------------------------------------------------------------------

    def _prefill(self, cmd: PrefillTicket) -> PrefillDone:
        # A ticket larger than the whole cache is named as such, with the fix (the free-block
        # check below said "N free of N (the others hold tickets ...)" for it).
        problem = self._cache_problem(cmd.rows)
        if problem is not None:
            raise VllmCacheFull(problem)
        (done,) = self._prefill_together([cmd])
        if isinstance(done, PrefillFailed):
            raise RuntimeError(done.message)
        return done

    def _prefill_tickets(self, cmd: PrefillTickets) -> tuple[PrefillDone | PrefillFailed, ...]:
        # One kvrelay rank drives every vLLM worker: a failed shared pass is retried ticket by
        # ticket here (ctx.world_size is 1), as the built-in engine does with TP=1. A shared pass
        # whose rows do not fit vLLM's free blocks raises VllmCacheFull before it starts: each
        # ticket then goes alone, and one that still does not fit fails at once.
        return prefill_tickets(
            cmd, self.ctx, drop=self._drop,
            row_problem=lambda rows: row_problem(rows, self.max_tokens, self.vocab) or self._cache_problem(rows),
            together=self._prefill_together,
        )  # fmt: skip

    def _blocks_for(self, rows: Sequence[Sequence[int]]) -> int:
        # vLLM gives a prompt of n tokens ceil(n / block_size) blocks (max_tokens=1: the sampled
        # token is never stored).
        return sum(-(-len(ids) // self.block_size) for ids in rows)

    def _cache_problem(self, rows: tuple[tuple[int, ...], ...]) -> str | None:
        """A ticket whose rows could never be held in vLLM's cache at once (a pure check)."""
        needed, total = self._blocks_for(rows), self._stats().total_blocks
        if needed > total:
            return (
                f"its rows need {needed} KV blocks of {self.block_size} tokens at once; vLLM's whole "
                f"cache has {total} (raise VLLM_CPU_KVCACHE_SPACE or vllm_args.kv_cache_memory_bytes, or "
                "shorten the rows)"
            )
        return None

    def _check_free_blocks(self, items: Sequence[PrefillTicket]) -> None:
        stats = self._stats()
        needed = self._blocks_for([ids for item in items for ids in item.rows])
        if needed > stats.free_blocks:
            raise VllmCacheFull(
                f"the rows need {needed} KV blocks of {self.block_size} tokens; vLLM has {stats.free_blocks} "
                f"free of {stats.total_blocks} (the others hold tickets not yet written)"
            )

    def _prefill_together(self, items: Sequence[PrefillTicket]) -> list[PrefillDone | PrefillFailed]:
        """Every row of `items` added to vLLM and stepped together until each finished; each
        ticket's rows then held as its own (`seconds`: the shared pass's time). A ticket that vLLM
        ended without its KV fails alone (its held rows released); a timeout or an exception
        aborts every row, releases every held row of the command and raises."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from kvrelay.ar_service.vllm_connector import ROW_KEY, TICKET_KEY, HeldRow

        # request id -> (item index, row)
        requests: dict[str, tuple[int, int]] = {}
        for k, item in enumerate(items):
            # A retried prefill must not hold the blocks twice.
            self._drop(item.ticket_id)
            requests.update({f"{item.ticket_id}/{row}": (k, row) for row in range(len(item.rows))})
        self._check_free_blocks(items)
        start = time.perf_counter()
        held: dict[str, Any] = {}
        unheld: list[str] = []
        deadline = time.monotonic() + self.spec.prefill_timeout_s
        faulty = [
            it.ticket_id
            for it in items
            if self._fault_tokens and any(_contains(r, self._fault_tokens) for r in it.rows)
        ]
        try:
            for request_id, (k, row) in requests.items():
                params = SamplingParams(
                    max_tokens=1,
                    temperature=0.0,
                    extra_args={"kv_transfer_params": {TICKET_KEY: items[k].ticket_id, ROW_KEY: row}},
                )
                prompt = TokensPrompt(prompt_token_ids=list(items[k].rows[row]))
                self.engine.add_request(request_id, prompt, params)
            while len(held) + len(unheld) < len(requests):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"vLLM did not finish the prefill within {self.spec.prefill_timeout_s:.0f}s"
                    )
                for out in self.engine.step():
                    if not out.finished or out.request_id not in requests:
                        continue
                    kept: dict[str, Any] = getattr(out, "kv_transfer_params", None) or {}
                    if kept.get("kvrelay_held"):
                        held[out.request_id] = HeldRow(
                            row=requests[out.request_id][1],
                            request_id=str(kept["kvrelay_request_id"]),
                            block_ids=tuple(kept["kvrelay_block_ids"]),
                            num_tokens=int(kept["kvrelay_num_tokens"]),
                        )
                    else:
                        unheld.append(out.request_id)
                if faulty and (held or unheld):
                    raise InjectedPrefillFault(
                        f"injected prefill fault ({PREFILL_FAULT_ENV}) in ticket {faulty[0]}"
                    )
        except BaseException:
            # Aborted requests free their blocks at once (the connector holds only complete rows);
            # the steps let the scheduler act on the abort before the next command.
            self.engine.abort_request([r for r in requests if r not in held and r not in unheld])
            self._release([h.request_id for h in held.values()])
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        seconds = time.perf_counter() - start
        first = self._descriptions[0]
        item_bytes = 4 if first.dtype == "float32" else 2
        token_bytes = first.num_layers * 2 * first.num_kv_heads_local * first.head_dim * item_bytes
        results: list[PrefillDone | PrefillFailed] = []
        for k, item in enumerate(items):
            mine = [r for r, (i, _) in requests.items() if i == k]
            rows = tuple(held[r] for r in mine if r in held)  # in row order (requests is)
            missing = [r for r in mine if r not in held]
            wrong = [f"row {h.row}: {h.num_tokens} tokens, expected {len(ids)}"
                     for h, ids in zip(rows, item.rows, strict=False) if h.num_tokens != len(ids)]  # fmt: skip
            problem = (
                f"vLLM ended rows {missing} without their KV (aborted or failed)" if missing
                else f"vLLM computed the wrong token counts: {wrong}" if wrong else None
            )  # fmt: skip
            if problem is not None:
                self._release([r.request_id for r in rows])
                results.append(PrefillFailed(self.ctx.rank, item.ticket_id, problem))
                continue
            self._held[item.ticket_id] = rows
            kv_bytes = sum(r.num_tokens for r in rows) * token_bytes
            counts = tuple(len(ids) for ids in item.rows)
            results.append(PrefillDone(self.ctx.rank, counts, kv_bytes, seconds))
        return results

    # -- write / drop ------------------------------------------------------------------------------

    def _write(self, cmd: WriteTicket) -> WriteDone:
        from kvrelay.ar_service.vllm_connector import VllmWriteTicket, write_on_worker
        from kvrelay.transfer.transport import not_started_outcomes

        rows = self._held.pop(cmd.ticket_id, None)
        if rows is None:
            mine = [w for w in cmd.plan]
            return WriteDone(
                self.ctx.rank,
                tuple(not_started_outcomes(mine, "vLLM holds no KV for this ticket")),
                0,
                0.0,
                0.0,
            )
        request_ids = [r.request_id for r in rows]
        done: list[WriteDone] = []
        try:
            done = self.engine.collective_rpc(write_on_worker, args=(VllmWriteTicket(cmd, rows),))
        finally:
            if done:
                # Each worker copied the rows out and released their blocks before its transport
                # call (an in-doubt call reads only its staging region): these steps let the
                # scheduler learn it (finished_sending) and free them.
                self._settle(request_ids)
            else:
                # collective_rpc raised: a worker may have failed before releasing the rows.
                self._release(request_ids)
        return WriteDone(
            self.ctx.rank,
            tuple(o for d in done for o in d.outcomes),
            sum(d.packed_bytes for d in done),
            max((d.pack_seconds for d in done), default=0.0),
            max((d.write_seconds for d in done), default=0.0),
            sum(d.engine_replacements for d in done),
        )

    def _collect_finished(self) -> FinishedWrites:
        """In-doubt writes whose transport calls returned, over every vLLM worker (their blocks
        went back to vLLM when the write copied them out)."""
        from kvrelay.ar_service.vllm_connector import collect_on_worker

        results: list[FinishedWrites] = self.engine.collective_rpc(collect_on_worker)
        return FinishedWrites(
            self.ctx.rank,
            tuple(f for r in results for f in r.finished),
            tuple(sorted({t for r in results for t in r.in_doubt_tickets})),
            sum(r.staging_bytes_held for r in results),
        )

    def _drop(self, ticket_id: str) -> None:
        rows = self._held.pop(ticket_id, None)
        if rows:
            self._release([r.request_id for r in rows])

    def _release(self, request_ids: list[str]) -> None:
        from kvrelay.ar_service.vllm_connector import release_on_worker

        if request_ids:
            self.engine.collective_rpc(release_on_worker, args=(request_ids,))
            self._settle(request_ids)

    def _settle(self, request_ids: list[str], timeout_s: float = 30.0) -> None:
        connector = self._scheduler().connector
        deadline = time.monotonic() + timeout_s
        while any(r in connector.held_requests() for r in request_ids):
            if time.monotonic() > deadline:
                log.error("vllm_blocks_not_returned", request_ids=request_ids)
                return
            self.engine.step()

    def close(self) -> None:
        for ticket_id in list(self._held):
            self._drop(ticket_id)
        engine = getattr(self, "engine", None)
        if engine is not None:
            shutdown = getattr(engine.engine_core, "shutdown", None)
            if shutdown is not None:
                shutdown()


def _describe(worker: Any) -> Any:
    from kvrelay.ar_service.vllm_connector import describe_worker

    return describe_worker(worker)


class VllmTokenizer:
    """vLLM's tokenizer for a model directory through transformers' `AutoTokenizer` (imports
    torch): the AR service's fallback when vllm_tokenizer.BackendTokenizer cannot give vLLM's ids
    without it (kvrelay.ar_service.vllm_tokenizer.service_tokenizer). Ids with special tokens as
    vLLM adds them to a completion prompt. Prefill sends vLLM the service's ids, never the text, so
    the counts the broker reserved are the tokens vLLM computes."""

    def __init__(self, directory: str) -> None:
        from transformers import AutoTokenizer

        # transformers opens the files itself: each passes kvrelay's bound first (a pipe there
        # blocked this process, /dev/zero was read until memory ran out).
        check_tokenizer_files(directory)
        self._tok = AutoTokenizer.from_pretrained(directory)
        self.vocab_size = len(self._tok)
        self.bos_id: int | None = self._tok.bos_token_id
        self.eos_id: int | None = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text, add_special_tokens=True)]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


# -- the service's tokenizer ---------------------------------------------------------------------

# What the ids of `encode` go through, below vLLM's pass-through wrappers: a tokenizer class that
# defines any of these may compute other ids than its Rust backend.
ENCODE_PATH_METHODS = frozenset({
    "encode", "encode_plus", "_encode_plus", "batch_encode_plus", "_batch_encode_plus", "__call__",
    "_get_padding_truncation_strategies", "set_truncation_and_padding", "tokenize", "_tokenize",
    "prepare_for_tokenization",
})  # fmt: skip
# vLLM's wrappers around the transformers tokenizer it loaded (caching, a thread pool of copies):
# their encode calls the wrapped class's.
_VLLM_WRAPPER_MODULE = "vllm.tokenizers.hf"


def describe_engine_tokenizer(tok: Any) -> EngineTokenizer:
    """Runs in vLLM's engine process, on vLLM's own tokenizer (`LLMEngine.get_tokenizer()`)."""
    # Serialized before any encode: as loaded, with what tokenizer.json enables (truncation,
    # padding), which transformers' encode turns off per call and BackendTokenizer turns off.
    backend_json, reason = _backend_json(tok)
    probe_ids = tuple(
        tuple(int(i) for i in tok.encode(text, add_special_tokens=True)) for text in PROBE_TEXTS
    )
    return EngineTokenizer(
        class_name=next(c.__name__ for c in type(tok).__mro__ if c.__module__ != _VLLM_WRAPPER_MODULE),
        vocab_size=len(tok),
        bos_id=_optional_int(getattr(tok, "bos_token_id", None)),
        eos_id=_optional_int(getattr(tok, "eos_token_id", None)),
        probe_ids=probe_ids,
        backend_json=backend_json,
        reason=reason,
        split_special_tokens=bool(getattr(tok, "split_special_tokens", False)),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _backend_json(tok: Any) -> tuple[str | None, str]:
    """(the backend's JSON, "") when `tok.encode` computes exactly its backend's ids, else (None, why)."""
    try:
        from tokenizers import Tokenizer
        from transformers import TokenizersBackend
    except ImportError as exc:
        return None, f"cannot check vLLM's tokenizer class ({exc})"
    name = type(tok).__name__
    if not isinstance(tok, TokenizersBackend):
        return None, f"vLLM's tokenizer is {name} (not a transformers TokenizersBackend with a Rust backend)"
    for cls in type(tok).__mro__:
        if cls is TokenizersBackend:
            break
        if cls.__module__ == _VLLM_WRAPPER_MODULE:
            continue
        overridden = sorted(ENCODE_PATH_METHODS & set(vars(cls)))
        if overridden:
            return (
                None,
                f"{cls.__module__}.{cls.__qualname__} defines {', '.join(overridden)} (its own encode path)",
            )
    backend = tok.backend_tokenizer
    if not isinstance(backend, Tokenizer):
        return None, f"vLLM's tokenizer backend is {type(backend).__name__}, not a tokenizers.Tokenizer"
    return str(backend.to_str()), ""


def service_tokenizer(engine: EngineTokenizer, directory: str) -> BackendTokenizer | VllmTokenizer:
    """The tokenizer of the vLLM AR's service process: BackendTokenizer (no torch) when it gives
    vLLM's ids, else transformers' AutoTokenizer of `directory` (imports torch), logged with why."""
    problem = torch_free_problem(engine)
    if problem is None:
        log.info("vllm_tokenizer_in_service", backend="tokenizers", tokenizer_class=engine.class_name)
        return BackendTokenizer(engine)
    log.warning(
        "vllm_tokenizer_in_service", backend="transformers", tokenizer_class=engine.class_name,
        reason=problem, effect="the AR service process imports torch",
    )  # fmt: skip
    fallback = VllmTokenizer(directory)
    for text, theirs in zip(PROBE_TEXTS, engine.probe_ids, strict=False):  # none without vLLM's tokenizer
        if tuple(fallback.encode(text)) != theirs:
            # vLLM gets the service's ids either way (the broker's counts stay exact); its own
            # text tokenization (a tokenizer_mode in vllm_args, a Mistral tokenizer) differs.
            log.warning("vllm_tokenizer_ids_differ", text=text[:40], service=fallback.encode(text)[:8], vllm=list(theirs[:8]))
            break
    return fallback
