"""Rank worker harness: one process per tensor/sequence parallel rank, driven by its service.

Owns the lifecycle of rank processes (spawn, startup handshake, commands, stop, death detection)
and the per-replica lock file. It guarantees DESIGN.md section 1's rules: workers die with their
parent (PR_SET_PDEATHSIG), a replica's lock is held by the service *and* every one of its workers
(each inherits the locked file description), so a new incarnation that takes the lock proves that
no process of the old one is alive; each worker sets torch's thread count to its share of cores.
Each rank also writes a liveness beat (a timestamp in shared memory, from its own thread), so a
rank that is stopped (SIGSTOP, a frozen cgroup) or not scheduled at all is seen by the service
without a command having to go through its (serialized) pipe: `check_alive` / `watch_ranks`.

What a rank computes is not this module's business: the service passes a picklable
`worker_factory(ctx: RankContext) -> handler`, and each rank runs `handler.handle(command)` for
the typed (frozen dataclass) commands the service sends. Commands go to every rank in the same
order (one caller at a time), so collectives inside handlers line up across ranks.

`import kvrelay.worker` does not import torch: ranks import it after their thread settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

# A beat gap over this starts a new stall-free run (StallFreeRun); the broker's proof window adds
# it for the stops it misses (KvRelayConfig.receiver_proof_window_seconds, docs/broker.md, Draining).
from kvrelay.config import STALL_GAP_SECONDS

if TYPE_CHECKING:
    from kvrelay.models.parallel import TpGroup

LOCK_DIR_ENV = "KVRELAY_LOCK_DIR"


def default_lock_dir() -> Path:
    """Where replica locks live: `$KVRELAY_LOCK_DIR`, else one folder per user under the system's
    temporary folder. Never relative to the working directory: a second `kvrelay ar --replica 0`
    started from another folder must find the first one's lock, or its registration would pass
    for proof that the first incarnation (and every write it may still have in flight) is gone."""
    configured = os.environ.get(LOCK_DIR_ENV)
    if configured:
        return Path(configured).resolve()
    return Path(tempfile.gettempdir()).resolve() / f"kvrelay-{os.getuid()}" / "locks"
_PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class WorkerGroupError(RuntimeError):
    """Base of every error the harness raises."""


class WorkerDied(WorkerGroupError):
    """A rank process exited without being asked to. The group is unusable afterwards (its
    collectives can never complete), so the harness has already stopped the other ranks."""

    def __init__(self, rank: int, exitcode: int | None, during: str = ""):
        self.rank = rank
        self.exitcode = exitcode
        how = f"exit code {exitcode}"
        if exitcode is not None and exitcode < 0:
            with contextlib.suppress(ValueError):
                how = f"signal {signal.Signals(-exitcode).name}"
        super().__init__(f"worker rank {rank} died ({how})" + (f" during {during}" if during else ""))


class WorkerTimeout(WorkerGroupError):
    """Ranks did not answer in time. The group is stopped: a rank stuck in a collective cannot
    be told apart from a hung one, and the next command would pair with stale collectives."""

    def __init__(self, ranks: Sequence[int], during: str, timeout_s: float):
        self.ranks = tuple(ranks)
        super().__init__(f"worker ranks {list(ranks)} did not answer {during} within {timeout_s:.1f}s")


class WorkerStalled(WorkerGroupError):
    """A rank's liveness beat was silent past the limit: it is stopped (SIGSTOP, a frozen cgroup)
    or hung so hard that not even its beat thread runs. It can never be trusted to finish a
    collective or a transfer, so the whole group was killed (fail-stop: the lock goes with the
    ranks, and a new incarnation proves them gone)."""

    symptom = "silent"
    verdict = "stopped or hung"

    def __init__(self, ranks: Sequence[int], silence_s: Sequence[float], limit_s: float, states: Sequence[str]):
        self.ranks = tuple(ranks)
        self.silence_s = tuple(silence_s)
        what = ", ".join(
            f"rank {r} {self.symptom} {t:.1f}s{f' (process state {st})' if st else ''}"
            for r, t, st in zip(ranks, silence_s, states, strict=True)
        )
        super().__init__(f"worker {what}: over the {limit_s:.1f}s limit, {self.verdict}; the group was killed")


class WorkerUnresponsive(WorkerStalled):
    """A rank's beat runs, but its command loop left the watchdog's `Ping` unanswered past the same
    limit (counted from when the Ping reached its pipe, never while it waited behind a running
    command): hung as surely as a silent rank, and killed with its group the same way."""

    symptom = "did not answer a Ping for"
    verdict = "hung"


class WorkerGroupBroken(WorkerGroupError):
    """A command was sent to a group that already failed (a rank died or timed out) or stopped."""


@dataclass(frozen=True, slots=True)
class RankError:
    """What a handler raised, as it crosses the pipe. `exception` is the original exception when
    it pickles (so services can map their own error types), else None."""

    rank: int
    error_type: str
    message: str
    traceback: str
    exception: BaseException | None = None


class WorkerCommandError(WorkerGroupError):
    """One or more ranks' handlers raised. The group stays usable: every rank answered.
    `values`: per rank, what a rank that did not raise answered (None for a rank that raised or
    gave no answer), so a caller can tell which ranks' work is known."""

    def __init__(self, command: object, errors: Sequence[RankError], values: Sequence[Any] = ()):
        self.command = command
        self.errors = tuple(errors)
        self.values = tuple(values)
        first = self.errors[0]
        super().__init__(
            f"{command.name if isinstance(command, _Named) else type(command).__name__} failed on rank(s) "
            f"{[e.rank for e in self.errors]}: "
            f"{first.error_type}: {first.message}\n--- rank {first.rank} traceback ---\n{first.traceback}"
        )

    @property
    def first_exception(self) -> BaseException | None:
        return self.errors[0].exception


class LockTimeout(WorkerGroupError):
    """The replica lock stayed taken: another process of this replica of this deployment (a
    duplicate started by hand, or the previous incarnation's service or worker ranks) is alive.
    One line, naming the pid written by the holder (`holder_pid`, None when unreadable)."""

    def __init__(self, path: Path, timeout_s: float, holder: str, holder_pid: int | None = None):
        self.path = path
        self.holder_pid = holder_pid
        super().__init__(
            f"replica lock {path} still held after {timeout_s:.1f}s by {holder}: another process of "
            "this replica (a duplicate, or the previous incarnation's service or worker ranks) is alive"
        )


# ---------------------------------------------------------------------------------------------
# Commands and values that cross the pipe
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stop:
    """Close the handler and end the rank process. Sent by WorkerGroup.stop()."""


@dataclass(frozen=True, slots=True)
class Ping:
    """Answered by the harness itself (never reaches the handler) with the rank's RankInfo."""


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    world_size: int
    pid: int
    device: str
    backend: str
    num_threads: int


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a rank's handler factory gets. `tp` spans all ranks of the group (world group)."""

    rank: int
    world_size: int
    device: str
    backend: str
    num_threads: int
    tp: TpGroup


class RankHandler(Protocol):
    def handle(self, command: Any) -> Any:
        """Run one command on this rank; called once per command, in order, on every rank."""
        ...


@dataclass(frozen=True, slots=True)
class _Ok:
    value: Any


@dataclass(frozen=True, slots=True)
class _Err:
    error: RankError


@dataclass(frozen=True, slots=True)
class _Ready:
    info: RankInfo


@dataclass(frozen=True, slots=True)
class _RankSpec:
    rank: int
    world_size: int
    device: str
    backend: str
    init_address: str
    num_threads: int
    parent_pid: int
    dist_timeout_s: float
    env: tuple[tuple[str, str], ...] = field(default=())
    beat_interval_s: float = 0.5


# Plain pickle both ways: tensors travel inline (no shared-memory fds whose lifetime the other
# side would have to manage); big data between stages goes over the transfer plane, not here.
def _send(conn: Connection, obj: object) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _rank_error(rank: int, exc: BaseException) -> RankError:
    try:
        pickle.loads(pickle.dumps(exc))
        picklable: BaseException | None = exc
    except Exception:
        picklable = None
    return RankError(
        rank=rank,
        error_type=type(exc).__name__,
        message=str(exc),
        traceback="".join(traceback.format_exception(exc)),
        exception=picklable,
    )


# ---------------------------------------------------------------------------------------------
# Lock file
# ---------------------------------------------------------------------------------------------


GRPC_DEFAULT_PORT = 443  # what gRPC dials for a target without a port


def _split_target(target: str) -> tuple[str, str]:
    """(host, port) of a gRPC target as `make_channel` takes it: `HOST[:PORT]`, `[V6][:PORT]`,
    a bare IPv6 address, or the `dns:[//AUTHORITY/]`, `ipv4:`, `ipv6:` forms (first address)."""
    text = target.strip()
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if text.lower().startswith(scheme):
            text = text[len(scheme):]
            if scheme == "dns:" and text.startswith("//"):
                text = text[2:].partition("/")[2]  # the DNS server's authority is not the broker
            text = text.split(",")[0]
            break
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if text.count(":") > 1:  # a bare IPv6 address has no port
        return text, ""
    host, _, port = text.partition(":")
    return host, port


def _is_local_address(address: str) -> bool:
    """True when `address` belongs to this host (loopback, any-address, or an interface's):
    binding to it succeeds only then."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def deployment_key(broker_address: str) -> str:
    """The canonical name of the deployment a broker address stands for, so that every spelling
    of one broker takes the same replica locks: `localhost:P`, `127.0.0.1:P`, `[::1]:P`,
    `0.0.0.0:P`, `dns:///localhost:P` and this host's name all give `local:P`; a remote name gives
    its lowest resolved address (`10.0.0.5:P`); no port means gRPC's default (443).

    Any broker on this host is `local`: two local brokers on one port would need two distinct
    listen addresses, and treating them as one deployment only makes their replicas exclude each
    other (the safe side), while two spellings that do not collide let a duplicate replica pass
    for a new incarnation. A `unix:` target is keyed by its absolute path; a name that does not
    resolve by itself, lower-cased."""
    text = broker_address.strip()
    if text.lower().startswith("unix:"):
        path = text[len("unix:"):]
        path = path[2:] if path.startswith("//") else path
        return "unix:" + os.path.abspath(path)
    host, port_text = _split_target(text)
    port = int(port_text) if port_text.isdigit() else GRPC_DEFAULT_PORT
    try:
        infos = socket.getaddrinfo(host or "localhost", port, type=socket.SOCK_STREAM)
        addresses = sorted({str(info[4][0]).split("%")[0] for info in infos})
    except (OSError, UnicodeError):
        addresses = []
    if not addresses:
        return f"{host.lower()}:{port}"
    if any(_is_local_address(a) for a in addresses):
        return f"local:{port}"
    return f"{addresses[0]}:{port}"


def replica_lock_path(
    replica_id: str, lock_dir: str | os.PathLike[str] | None = None, *, deployment: str = ""
) -> Path:
    """The lock file of one replica of one deployment. `deployment` (the broker's address, as
    typed) keeps two deployments on one host from taking each other's locks; it is canonicalised
    by `deployment_key` first, so `--broker localhost:P` and `--broker 127.0.0.1:P` are one
    deployment. `lock_dir` defaults to `default_lock_dir()`, which does not depend on the working
    directory."""
    if lock_dir is None:
        lock_dir = default_lock_dir()
    if deployment:
        key = deployment_key(deployment)
        safe = "".join(c if c.isalnum() or c in "-." else "_" for c in key)
        return Path(lock_dir) / safe / f"{replica_id}.lock"
    return Path(lock_dir) / f"{replica_id}.lock"


class ReplicaLock:
    """Exclusive flock on a per-replica file, taken before the replica registers.

    The lock belongs to the open file description, which WorkerGroup hands to every rank: it is
    released only when the service and all its workers have exited (or all closed it). That is
    why `release()` closes this process's descriptor instead of unlocking (LOCK_UN would drop the
    lock for the workers too).
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def fileno(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"replica lock {self.path} is not held")
        return self._fd

    def acquire(
        self, timeout_s: float = 0.0, poll_s: float = 0.05, cancel: threading.Event | None = None
    ) -> ReplicaLock:
        """Take the lock, waiting up to `timeout_s` for a previous incarnation's processes to go.
        Raises InterruptedError when `cancel` is set first (the process was asked to stop)."""
        if self._fd is not None:
            return self
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            # Found black-box: KVRELAY_LOCK_DIR naming a file was `kvrelay dit: /x/local_47310:
            # Not a directory`, a path nobody typed and no word of the setting.
            configured = os.environ.get(LOCK_DIR_ENV)
            where = f"${LOCK_DIR_ENV}={configured}" if configured else f"its default {default_lock_dir()} (${LOCK_DIR_ENV} unset)"
            raise OSError(
                err.errno,
                f"{err.strerror or err} (cannot create this replica lock: its folder comes from {where}; "
                f"set {LOCK_DIR_ENV} to a folder this user can create and write, the same for every "
                "AR and DiT of the host)",
                str(self.path),
            ) from None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise
                if cancel is not None and cancel.is_set():
                    os.close(fd)
                    raise InterruptedError(f"waiting for the replica lock {self.path}") from None
                if time.monotonic() >= deadline:
                    holder_pid = self._read_holder(fd)
                    os.close(fd)
                    raise LockTimeout(self.path, timeout_s, _describe_holder(holder_pid), holder_pid) from None
                time.sleep(poll_s)
        # Who holds it, for the error message of the next incarnation; not used for correctness.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    @staticmethod
    def _read_holder(fd: int) -> int | None:
        try:
            text = os.pread(fd, 64, 0).decode(errors="replace").strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ReplicaLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _describe_holder(pid: int | None) -> str:
    """Who holds a lock, for its error message; not used for correctness (a pid may be reused)."""
    if pid is None:
        return "an unknown process"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid} (exited; one of its worker ranks still holds it)"
    except PermissionError:
        pass
    return f"pid {pid} (running)"


class _InheritedFd:
    """Pickles into the spawned child as the same open file description (multiprocessing passes
    the fd through exec), so the child shares the parent's flock."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_inherited_fd, (reduction.DupFd(self.fd),))


def _rebuild_inherited_fd(dup: Any) -> int:
    return int(dup.detach())


# ---------------------------------------------------------------------------------------------
# Rank process side
# ---------------------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died before prctl took effect; then we were re-parented already.
    if os.getppid() != parent_pid:
        os._exit(1)


class StallFreeRun:
    """The start of one process's current stall-free run, kept by its own beat (CLOCK_MONOTONIC):
    a beat that comes more than `gap_s` after the one before starts a new run. Only its own clock
    and its own beats: no cross-process or cross-host time."""

    def __init__(self, gap_s: float = STALL_GAP_SECONDS, now: float | None = None) -> None:
        self.gap_s = gap_s
        self.last_beat = self.since = time.monotonic() if now is None else now

    def beat(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self.last_beat > self.gap_s:
            self.since = now
        self.last_beat = now

    def seconds(self, now: float | None = None) -> float:
        """How long it has run without a stall, 0 while it may be stalled now (no beat for `gap_s`)."""
        return stall_free_seconds(self.last_beat, self.since, self.gap_s, now)


def stall_free_seconds(last_beat: float, since: float, gap_s: float, now: float | None = None) -> float:
    """How long a process whose last beat was at `last_beat` and whose run began at `since` (both
    CLOCK_MONOTONIC) has run without a stall: 0 once its beat is silent over `gap_s` (it may be
    stopped now; its next beat starts a new run)."""
    now = time.monotonic() if now is None else now
    if now - last_beat > gap_s:
        return 0.0
    return max(0.0, now - since)


async def beat_stall_free_run(run: StallFreeRun, interval_s: float = 0.5) -> None:
    """A service process's own beat, on its event loop, until cancelled: a stop of the process,
    or a loop blocked past the gap (what it serves, the gRPC-stream fallback's PutKv included,
    waits meanwhile), starts a new run."""
    while True:
        run.beat()
        await asyncio.sleep(interval_s)


def _start_beats(beats: Any, rank: int, interval_s: float, runs: Any = None) -> None:
    """Write this rank's liveness beat (CLOCK_MONOTONIC, one clock for every process of the host)
    from a thread of its own: it keeps beating while the main thread runs a long command, and
    stops only when the whole process does (stopped, frozen, or dead). With `runs`, also the start
    of its stall-free run (StallFreeRun), written before the beat that ends a gap, so that a
    reader never sees the fresh beat with the old run."""

    def beat() -> None:
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if runs is not None and now - last > STALL_GAP_SECONDS:
                runs[rank] = now
            beats[rank] = now
            last = now
            time.sleep(interval_s)

    threading.Thread(target=beat, name="kvrelay-rank-beat", daemon=True).start()


def _rank_main(
    spec: _RankSpec, conn: Connection, factory_bytes: bytes, lock_fd: int | None, beats: Any = None,
    runs: Any = None,
) -> None:
    _die_with_parent(spec.parent_pid)
    if beats is not None:
        _start_beats(beats, spec.rank, spec.beat_interval_s, runs)
    # The service orchestrates shutdown (Stop, or PDEATHSIG when it dies); a terminal's Ctrl-C
    # reaching the workers directly would kill them mid-collective and bury the real error.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # lock_fd is deliberately never closed: this process holds the replica lock until it exits.
    for key, value in spec.env:
        os.environ[key] = value
    threads = str(spec.num_threads)
    os.environ["OMP_NUM_THREADS"] = threads
    os.environ["MKL_NUM_THREADS"] = threads
    # Idle OpenMP threads sleep rather than spin (read when torch loads its OpenMP runtime, just
    # below): an AR and a DiT on one host take turns on the same cores, and a spinning idle pool
    # steals them from the stage that has work (node/supervisor.py: cpu_share_env). The
    # variable, set in the environment, wins.
    if not spec.device.startswith("cuda"):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch

    torch.set_num_threads(spec.num_threads)
    if spec.device.startswith("cuda"):
        # Before any CUDA work, so default allocations and NCCL land on this rank's GPU.
        torch.cuda.set_device(torch.device(spec.device))
    with contextlib.suppress(RuntimeError):  # only settable before any inter-op work
        torch.set_num_interop_threads(1)

    from kvrelay.models.parallel import destroy_process_group, init_process_group

    handler: Any = None
    try:
        tp = init_process_group(
            spec.rank,
            spec.world_size,
            spec.init_address,
            backend=spec.backend,
            device=spec.device,
            timeout_s=spec.dist_timeout_s,
        )
        ctx = RankContext(spec.rank, spec.world_size, spec.device, spec.backend, spec.num_threads, tp)
        # Unpickled only now, so the factory's module imports (torch, models) see our thread settings.
        factory = pickle.loads(factory_bytes)
        handler = factory(ctx)
    except BaseException as exc:
        _send(conn, _Err(_rank_error(spec.rank, exc)))
        conn.close()
        os._exit(3)
    info = RankInfo(
        spec.rank, spec.world_size, os.getpid(), spec.device, spec.backend, torch.get_num_threads()
    )
    _send(conn, _Ready(info))
    try:
        while True:
            try:
                command = _recv(conn)
            except (EOFError, OSError):
                break  # the service is gone or closed the pipe: nothing left to serve
            if isinstance(command, Stop):
                _close_handler(handler)
                handler = None
                _send(conn, _Ok(None))
                break
            if isinstance(command, Ping):
                _send(conn, _Ok(info))
                continue
            try:
                reply: object = _Ok(handler.handle(command))
            except Exception as exc:
                reply = _Err(_rank_error(spec.rank, exc))
            try:
                _send(conn, reply)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                _send(conn, _Err(_rank_error(spec.rank, exc)))
    finally:
        _close_handler(handler)
        destroy_process_group()
        conn.close()
    # Closed and disconnected: what is left of the exit is the interpreter's teardown of torch and
    # the model (0.5-1 s), which every stop of the replica waited for (it joins its ranks).
    from kvrelay.stopping import exit_without_teardown

    exit_without_teardown(0)


def _close_handler(handler: Any) -> None:
    close = getattr(handler, "close", None)
    if close is not None:
        close()


# ---------------------------------------------------------------------------------------------
# Service side
# ---------------------------------------------------------------------------------------------


class DeviceUnavailable(WorkerGroupError):
    """A configured device does not exist on this host (checked before any worker starts)."""


def _driver_device_count() -> int | None:
    """The CUDA devices this process sees (CUDA_VISIBLE_DEVICES applied), asked of the driver
    (libcuda's cuInit and cuDeviceGetCount, what torch's count runs on), without torch; None when
    the driver does not answer (no libcuda, no device, an error)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return None
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return int(count.value)


def _device_index(device: str) -> int:
    """N of `cuda:N` (0 for a bare `cuda`, as torch's current device at start)."""
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


def check_devices(devices: Sequence[str], where: str = "devices") -> None:
    """Raise DeviceUnavailable, in one line, when a `cuda:N` device of `devices` is not on this host
    (a CPU-only torch, no driver, or fewer GPUs than configured).

    A service checks before it spawns its ranks and imports no torch (only its ranks do: seconds
    and hundreds of MB of every start): the driver's device count is enough when it answers;
    torch is asked only when it does not, to say why (a CPU-only torch build, no device)."""
    wanted = sorted({d for d in devices if d.startswith("cuda")})
    if not wanted:
        return
    count = _driver_device_count()
    if count:
        missing = [d for d in wanted if _device_index(d) >= count]
        if missing:
            raise DeviceUnavailable(
                f"{where}: {', '.join(missing)} configured, but this host has {count} visible CUDA device(s)"
            )
        return
    import torch

    if not torch.cuda.is_available():
        reason = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise DeviceUnavailable(
            f"{where}: {', '.join(wanted)} configured, but {reason} on this host "
            f"(set devices: cpu, or run on a GPU host)"
        )
    count = torch.cuda.device_count()
    missing = [d for d in wanted if torch.device(d).index is not None and torch.device(d).index >= count]
    if missing:
        raise DeviceUnavailable(
            f"{where}: {', '.join(missing)} configured, but this host has {count} visible CUDA device(s)"
        )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_threads_per_rank(world_size: int) -> int:
    """This process's share of the cores it may run on (affinity, which equals os.cpu_count()
    on an unrestricted host) split over the ranks: ranks of one replica compute at the same
    time, and ranks that oversubscribe cores slow each other down in every collective.

    `KVRELAY_THREADS_PER_RANK` overrides it: `kvrelay up` on one small host runs several
    replicas side by side, and only the supervisor knows how many compute at once.
    """
    override = os.environ.get("KVRELAY_THREADS_PER_RANK")
    if override:
        return max(1, int(override))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


# How long a collective (gloo, NCCL) waits for its peers before it fails, for a replica that
# tolerates no stop at all; `collective_timeout_s` adds the replica's stall limit to it.
DIST_TIMEOUT_S = 300.0


def collective_timeout_s(max_silence_s: float) -> float:
    """The collective timeout of a replica whose ranks may be stopped for up to `max_silence_s`
    (its `rank_stall_seconds`): the normal wait plus that stop. A peer stopped for less than the
    limit in the middle of a collective must not make the others' collective fail first (that
    ends the command and fail-stops the replica, so a stop under the limit would not be tolerated
    after all); past the limit the watchdog kills the group anyway."""
    return DIST_TIMEOUT_S + max_silence_s


def choose_backend(devices: Sequence[str]) -> str:
    """gloo for CPU ranks and for ranks that share a GPU; NCCL when every rank has its own GPU.

    Here, not in kvrelay.models.parallel (which re-exports it): a service picks its ranks' backend
    before it spawns them, and importing parallel there imported torch into the service process,
    several seconds of its start before any rank was spawned."""
    if not devices or any(not d.startswith("cuda") for d in devices):
        return "gloo"
    if len(set(devices)) < len(devices):
        return "gloo"
    return "nccl"


class WorkerGroup:
    """`world_size` rank processes, each running `worker_factory(RankContext)`'s handler.

    Usage: `with WorkerGroup(2, factory) as group: results = group.call_all(MyCommand(...))`.
    `devices` is one device string per rank ("cpu", "cuda:0", ...); the collective backend is
    chosen from them (choose_backend) unless given. Pass the replica's held
    `lock` so the workers share it. Not thread-safe to start/stop concurrently; calls are
    serialized internally (one command in flight), so any thread may call.
    """

    def __init__(
        self,
        world_size: int,
        worker_factory: Callable[[RankContext], Any],
        *,
        devices: Sequence[str] | None = None,
        backend: str | None = None,
        lock: ReplicaLock | None = None,
        threads_per_rank: int | None = None,
        start_timeout_s: float = 180.0,
        dist_timeout_s: float = DIST_TIMEOUT_S,
        env: dict[str, str] | None = None,
        name: str = "kvrelay-rank",
        error_grace_s: float = 10.0,
        beat_interval_s: float = 0.5,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.devices = list(devices) if devices is not None else ["cpu"] * world_size
        if len(self.devices) != world_size:
            raise ValueError(f"{len(self.devices)} devices given for world_size={world_size}")
        self._factory_bytes = pickle.dumps(worker_factory)  # fails here, not in the child
        self._backend = backend
        self._lock = lock
        self.threads_per_rank = threads_per_rank or default_threads_per_rank(world_size)
        self._start_timeout_s = start_timeout_s
        self._dist_timeout_s = dist_timeout_s
        self._env = tuple(sorted((env or {}).items()))
        self._name = name
        self.error_grace_s = error_grace_s
        self.beat_interval_s = beat_interval_s
        self._beats: Any = None  # ctypes double[world_size] shared with the ranks, set by start()
        self._runs: Any = None  # each rank's stall-free run start (StallFreeRun), likewise
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._call_lock = threading.Lock()
        self._keeper_release = threading.Event()
        self._broken: WorkerGroupError | None = None
        # The watchdog's Ping in flight: when it reached every rank's pipe (None: none, or it still
        # waits for the call lock behind a command), and the ranks that have not answered it yet.
        self._ping_sent_at: float | None = None
        self._awaiting: tuple[int, ...] = ()
        self._started = False
        self._stopped = False
        self.infos: list[RankInfo] = []

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def backend(self) -> str:
        if self._backend is None:
            self._backend = choose_backend(self.devices)
        return self._backend

    def start(self) -> list[RankInfo]:
        """Spawn every rank and wait until each has built its handler. Raises WorkerDied or
        WorkerCommandError (a factory raised) after stopping whatever started."""
        if self._started:
            raise RuntimeError("WorkerGroup already started")
        self._started = True
        ctx = mp.get_context("spawn")
        init_address = f"tcp://127.0.0.1:{free_port()}"
        lock_arg = _InheritedFd(self._lock.fileno()) if self._lock is not None else None
        self._beats = ctx.RawArray("d", self.world_size)
        self._runs = ctx.RawArray("d", self.world_size)
        for rank in range(self.world_size):
            self._beats[rank] = self._runs[rank] = time.monotonic()  # silence is counted from the spawn
        child_conns = []
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            spec = _RankSpec(
                rank=rank,
                world_size=self.world_size,
                device=self.devices[rank],
                backend=self.backend,
                init_address=init_address,
                num_threads=self.threads_per_rank,
                parent_pid=os.getpid(),
                dist_timeout_s=self._dist_timeout_s,
                env=self._env,
                beat_interval_s=self.beat_interval_s,
            )
            proc = ctx.Process(
                target=_rank_main,
                args=(spec, child_conn, self._factory_bytes, lock_arg, self._beats, self._runs),
                name=f"{self._name}-{rank}",
                daemon=True,
            )
            self._procs.append(proc)
            self._conns.append(parent_conn)
            child_conns.append(child_conn)
        self._spawn_from_keeper_thread()
        for c in child_conns:
            c.close()
        if self._stopped:
            # kill() from another thread (a stop requested during start-up) came before the ranks
            # had pids: it could not kill them, so they go here, before the wait for them.
            self._kill_all()
            raise WorkerGroupBroken("worker group killed while starting")
        try:
            replies = self._gather(range(self.world_size), "startup", self._start_timeout_s)
        except WorkerGroupError:
            self._kill_all()
            raise
        errors = [r.error for r in replies if isinstance(r, _Err)]
        if errors:
            self._kill_all()
            self._broken = WorkerGroupBroken("worker group failed to start")
            raise WorkerCommandError(_Named("startup"), errors)
        self.infos = [r.info for r in replies]
        return self.infos

    def _spawn_from_keeper_thread(self) -> None:
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process.
        # Services call start() from executor threads that may come and go, so the processes are
        # forked by a thread that lives until stop().
        started = threading.Event()
        failure: list[BaseException] = []

        def keeper() -> None:
            try:
                for proc in self._procs:
                    proc.start()
            except BaseException as exc:
                failure.append(exc)
            finally:
                started.set()
            self._keeper_release.wait()

        threading.Thread(target=keeper, name=f"{self._name}-keeper", daemon=True).start()
        started.wait()
        if failure:
            self._kill_all()
            raise failure[0]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask every rank to close its handler and exit; kill those that do not within
        `timeout_s`. A command still in flight after `timeout_s` is not waited for: the ranks
        are killed and that call raises WorkerDied. Idempotent."""
        if self._stopped or not self._started:
            self._stopped = True
            return
        self._stopped = True
        if not self._call_lock.acquire(timeout=timeout_s):
            self.kill()
            return
        try:
            alive = [r for r, p in enumerate(self._procs) if p.is_alive()]
            for rank in alive:
                with contextlib.suppress(OSError, ValueError):
                    _send(self._conns[rank], Stop())
            deadline = time.monotonic() + timeout_s
            for rank in alive:
                self._procs[rank].join(max(0.0, deadline - time.monotonic()))
            self._kill_all()
            if self._broken is None:
                self._broken = WorkerGroupBroken("worker group stopped")
        finally:
            self._call_lock.release()

    def kill(self) -> None:
        """SIGKILL every rank now, without waiting for a command in flight (fail-stop: the
        service must stop its workers before unregistering memory). The caller blocked in
        that command gets WorkerDied; the group is unusable afterwards."""
        self._stopped = True
        if self._broken is None:
            self._broken = WorkerGroupBroken("worker group killed")
        for proc in self._procs:
            if proc.pid is not None and proc.is_alive():
                proc.kill()
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(5.0)
        if self._call_lock.acquire(blocking=False):
            try:
                self._kill_all()
            finally:
                self._call_lock.release()
        # else: the thread in call_each sees the dead ranks and closes the pipes itself.

    def _kill_all(self) -> None:
        for proc in self._procs:
            if proc.pid is not None and proc.is_alive():
                proc.kill()
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._conns = [_ClosedConn() for _ in self._conns]  # type: ignore[misc]
        self._keeper_release.set()

    def __enter__(self) -> WorkerGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- commands -------------------------------------------------------------------------------

    def call_all(self, command: object, timeout_s: float | None = None) -> list[Any]:
        """Send `command` to every rank; return each rank's result in rank order.

        Raises WorkerCommandError if any handler raised (group still usable), WorkerDied /
        WorkerTimeout if a rank died or did not answer (group stopped), WorkerGroupBroken if the
        group had already failed or was stopped.
        """
        return self.call_each([command] * self.world_size, timeout_s)

    def call_each(self, commands: Sequence[object], timeout_s: float | None = None) -> list[Any]:
        """Like call_all, with one command per rank (e.g. each rank's share of the writes)."""
        if len(commands) != self.world_size:
            raise ValueError(f"{len(commands)} commands for {self.world_size} ranks")
        with self._call_lock:
            if self._broken is not None:
                raise WorkerGroupBroken(f"worker group unusable: {self._broken}") from self._broken
            if not self._started:
                raise WorkerGroupBroken("worker group not started")
            for rank, command in enumerate(commands):
                try:
                    _send(self._conns[rank], command)
                except (OSError, ValueError):
                    self._fail(WorkerDied(rank, self._procs[rank].exitcode, type(command).__name__))
            if isinstance(commands[0], Ping):
                self._ping_sent_at = time.monotonic()
            try:
                replies = self._gather(range(self.world_size), type(commands[0]).__name__, timeout_s)
            finally:
                self._ping_sent_at = None
                self._awaiting = ()
        errors = [r.error for r in replies if isinstance(r, _Err)]
        if errors:
            values = [None if isinstance(r, _Err) else r.value for r in replies]
            raise WorkerCommandError(commands[errors[0].rank], errors, values)
        return [r.value for r in replies]

    def _fail(self, error: WorkerGroupError) -> None:
        if isinstance(self._broken, WorkerStalled):
            error = self._broken  # check_alive killed the ranks under this call: say why
        self._broken = error
        self._kill_all()
        raise error

    def _gather(self, ranks: Sequence[int] | range, during: str, timeout_s: float | None) -> list[Any]:
        pending = set(ranks)
        replies: list[Any] = [None] * self.world_size
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            self._awaiting = tuple(sorted(pending))
            if any(isinstance(r, _Err) for r in replies):
                # A rank failed; the others may be blocked in a collective that now never
                # completes. Give them a short grace to fail or finish on their own.
                grace_end = time.monotonic() + self.error_grace_s
                deadline = grace_end if deadline is None else min(deadline, grace_end)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            waitables: dict[Any, tuple[str, int]] = {}
            for rank in pending:
                waitables[self._conns[rank]] = ("conn", rank)
                waitables[self._procs[rank].sentinel] = ("proc", rank)
            ready = wait(list(waitables), timeout=left)
            if not ready:
                errors = [r.error for r in replies if isinstance(r, _Err)]
                if errors:
                    # Ranks that failed leave the rest stuck: the group cannot be trusted again.
                    self._broken = WorkerGroupBroken(f"ranks {sorted(pending)} hung after a rank failed")
                    self._kill_all()
                    raise WorkerCommandError(_Named(during), errors)
                self._fail(WorkerTimeout(sorted(pending), during, timeout_s or 0.0))
            dead = []
            for obj in ready:
                kind, rank = waitables[obj]
                if rank not in pending:
                    continue
                if kind == "conn":
                    try:
                        replies[rank] = _recv(self._conns[rank])
                    except (EOFError, OSError):
                        dead.append(rank)
                        continue
                    pending.discard(rank)
                else:
                    dead.append(rank)
            for rank in dead:
                # A rank may answer and then exit (startup failure): read the answer first.
                if rank in pending and self._conns[rank].poll():
                    with contextlib.suppress(EOFError, OSError):
                        replies[rank] = _recv(self._conns[rank])
                        pending.discard(rank)
                        continue
                if rank in pending:
                    self._procs[rank].join(1.0)
                    self._fail(WorkerDied(rank, self._procs[rank].exitcode, during))
        return replies

    def ping(self, timeout_s: float | None = 10.0) -> list[RankInfo]:
        """Every rank's command loop answers (it waits its turn behind a running command first;
        `timeout_s` counts from when it was sent). None: no deadline of its own, as the
        watchdog's: check_alive judges how long it is unanswered against the stall limit."""
        return self.call_all(Ping(), timeout_s)

    def ping_unanswered_s(self) -> float | None:
        """Seconds since a Ping in flight reached the ranks' pipes without every answer back yet;
        None when no Ping is in flight (or it still waits behind a running command)."""
        sent = self._ping_sent_at
        return None if sent is None else max(0.0, time.monotonic() - sent)

    # -- liveness -------------------------------------------------------------------------------

    def silence_s(self) -> list[float]:
        """Seconds since each rank's last liveness beat (since its spawn before the first)."""
        if self._beats is None:
            return [0.0] * self.world_size
        now = time.monotonic()
        return [max(0.0, now - float(self._beats[r])) for r in range(self.world_size)]

    def stall_free_s(self) -> list[float]:
        """How long each live rank has run without a stall (`stall_free_seconds`: 0 while its beat
        is silent over STALL_GAP_SECONDS), one entry per rank that runs: none before `start()`,
        after a stop, or for a rank that exited (its replica fails stop then)."""
        if self._beats is None or self._runs is None or self._stopped or self._broken is not None:
            return []
        now = time.monotonic()
        runs = []
        for rank, proc in enumerate(self._procs):
            if proc.pid is None or not proc.is_alive():
                continue
            # The beat first: the rank writes a new run before the beat that ends its gap, so a
            # run read after a fresh beat is that beat's (an old beat reads as stalled anyway).
            beat = float(self._beats[rank])
            runs.append(stall_free_seconds(beat, float(self._runs[rank]), STALL_GAP_SECONDS, now))
        return runs

    def check_alive(self, max_silence_s: float, observed_since: float | None = None) -> None:
        """Fail stop the group if a rank exited, its beat was silent over `max_silence_s`, or it left a
        Ping in flight unanswered over `max_silence_s` (one limit for a stopped and a hung rank):
        kill every rank and raise WorkerDied / WorkerStalled / WorkerUnresponsive (a command in
        flight raises the same).
        Does not wait for a running command (it takes no call lock), so a rank stopped in the
        middle of one is found. Raises WorkerGroupBroken if the group already failed; returns
        quietly before start and after a requested stop. `observed_since` (a `time.monotonic()`):
        count silence only from then, the start of the caller's continuous watch: a caller that was
        stopped itself (the whole replica paused, then continued) must not blame ranks that were
        stopped with it and have not been scheduled to beat yet."""
        if not self._started or isinstance(self._broken, WorkerGroupBroken):
            return  # not started, or stopped/killed on request (a failed command also raises itself)
        if self._broken is not None:
            raise WorkerGroupBroken(f"worker group unusable: {self._broken}") from self._broken
        error: WorkerGroupError | None = None
        for rank, proc in enumerate(self._procs):
            if proc.pid is not None and not proc.is_alive():
                error = WorkerDied(rank, proc.exitcode, "no command (found by the liveness check)")
                break
        if error is None:
            awaiting = self._awaiting  # read first: fresh whenever the Ping below is overdue
            unanswered = self.ping_unanswered_s()
            watched = None if observed_since is None else max(0.0, time.monotonic() - observed_since)
            verdict = overdue_ranks(self.silence_s(), unanswered, awaiting, max_silence_s, watched)
            if verdict is not None:
                kind, ranks, seconds = verdict
                error = kind(ranks, seconds, max_silence_s, [_process_state(self._procs[r].pid) for r in ranks])
        if error is None:
            return
        self._broken = error
        self.kill()
        raise error


def overdue_ranks(
    silence_s: Sequence[float],
    ping_unanswered_s: float | None,
    awaiting: Sequence[int],
    max_silence_s: float,
    watched_s: float | None = None,
) -> tuple[type[WorkerStalled], list[int], list[float]] | None:
    """check_alive's verdict, pure: the ranks over the stall limit and for how long, or None.

    `silence_s`: each rank's beat silence; `ping_unanswered_s`: how long the Ping in flight has
    been on the ranks' pipes (None: none sent), `awaiting` the ranks that have not answered it;
    `watched_s`: how long the caller has watched without a break (None: always), which caps both
    (what happened while the watcher was stopped itself is nobody's fault). A silent beat wins
    (WorkerStalled: a stopped rank's Ping is unanswered too); otherwise a Ping unanswered past
    the same `max_silence_s` (WorkerUnresponsive: its beat runs, its command loop does not)."""
    if watched_s is not None:
        silence_s = [min(t, watched_s) for t in silence_s]
        ping_unanswered_s = None if ping_unanswered_s is None else min(ping_unanswered_s, watched_s)
    stalled = [r for r, t in enumerate(silence_s) if t > max_silence_s]
    if stalled:
        return WorkerStalled, stalled, [silence_s[r] for r in stalled]
    if ping_unanswered_s is not None and ping_unanswered_s > max_silence_s and awaiting:
        return WorkerUnresponsive, list(awaiting), [ping_unanswered_s] * len(awaiting)
    return None


@dataclass(frozen=True, slots=True)
class _Named:
    """Stands for a phase (startup) or command in WorkerCommandError messages."""

    name: str


class _ClosedConn:
    """Placeholder for a closed pipe: sending raises like a broken pipe would."""

    def send_bytes(self, *_: object) -> None:
        raise OSError("worker pipe closed")

    def close(self) -> None:
        pass


def _process_state(pid: int | None) -> str:
    """The kernel's one-letter state of `pid` (T: stopped, D: uninterruptible), for messages."""
    if pid is None:
        return ""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


async def watch_ranks(
    group: WorkerGroup,
    on_lost: Callable[[str], None],
    *,
    interval_s: float,
    max_silence_s: float,
) -> None:
    """A replica's rank watchdog, until cancelled or a rank is lost (then `on_lost(reason)` once).

    Every `interval_s`: `check_alive(max_silence_s)` (a dead rank at once; a stopped one, even in
    the middle of a command, once its beat is silent over `max_silence_s`: the group is killed, so
    that command raises too), and a `Ping` when none is in flight (a rank whose command loop
    stopped answering while idle). The Ping has no deadline of its own: it waits its turn behind a
    running command, and once sent, check_alive holds it to the same `max_silence_s`, counted
    while this watchdog ran. So the stall limit is the one limit for a stopped or hung rank: a
    stop under it is tolerated however long it is (the Ping is answered when the rank runs again),
    one over it fail-stops."""
    ping: asyncio.Future[list[RankInfo]] | None = None
    # Silence counts only while this watchdog itself ran: when its own wake-up comes late by more
    # than a second (this process was stopped or starved too), watching starts again from now.
    last = observed_since = time.monotonic()
    try:
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            if now - last > interval_s + 1.0:
                observed_since = now
            last = now
            try:
                await asyncio.to_thread(group.check_alive, max_silence_s, observed_since)
                if ping is not None and ping.done():
                    ping.result()
                    ping = None
                if ping is None:
                    ping = asyncio.ensure_future(asyncio.to_thread(group.ping, None))
            except WorkerGroupError as err:
                on_lost(f"worker rank lost: {err}")
                return
    finally:
        if ping is not None:
            # Its error, if any, is the loss already reported; the thread ends with the group.
            ping.add_done_callback(lambda f: f.cancelled() or f.exception())
            ping.cancel()
