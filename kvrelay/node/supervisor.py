"""`kvrelay up`: run a whole node (broker + every AR and DiT replica) as child processes.

Owns child processes only: it starts the broker, waits for its gRPC health to say SERVING, then
starts every replica of the config and waits for each to be SERVING; prints where everything
listens; restarts a child that exits (exponential backoff, capped, logged); keeps asking a child
that was SERVING for its health and logs one line when it turns NOT_SERVING or stops answering
(naming its log) and one when it serves again, never restarting it for that; and on Ctrl-C,
SIGTERM or SIGHUP stops everything: SIGTERM to each child (replicas first, the broker last), a grace
period, then SIGKILL to whatever of a child's process group or descendants is still alive. A second
signal is a fast stop: each child still running gets its second SIGTERM (its own fast stop,
kvrelay/stopping.py: ranks killed, drain cut, exit 4), the grace shrinks to FAST_GRACE_SECONDS,
and `kvrelay up` exits EXIT_FAST_STOP.

Every child runs in its own session (a terminal's Ctrl-C reaches only the supervisor, which
orders the shutdown) and carries PR_SET_PDEATHSIG (SIGHUP: Linux may send it more than once, and
a repeated SIGHUP, unlike a second SIGTERM, never makes a child's stop fast), so a supervisor
killed with SIGKILL still takes its children down, each with its graceful stop. PDEATHSIG fires when the *thread* that forked exits, so all children are
forked by the node's one monitor thread, which lives exactly as long as the node.

It must never import a service package or torch: children are started as `python -m kvrelay`.
`Node` / `start_node` are the same machinery for tests and `kvrelay bench`.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import ctypes
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.config import ConfigError, KvRelayConfig, default_config_path, load_config
from kvrelay.limits import (
    LOG_TAIL_BYTES,
    MAX_CONFIG_FILE_BYTES,
    FileRefused,
    read_bounded_file,
    read_file_tail,
)
from kvrelay.logging import configure_logging, get_logger, quiet_grpc_core, with_quiet_grpc_core
from kvrelay.metrics import NodeMetricsServer
from kvrelay.ports import (
    Listen,
    PortInUse,
    check_ports_free,
    in_use_message,
    is_port_free,
    pick_free_port,
)
from kvrelay.security import (
    BROKER_CALLER_ID,
    CallerClass,
    Credentials,
    SecurityError,
    check_bind,
    load_credentials,
    make_sync_channel,
    node_token_env,
    read_tls,
    tls_files,
)
from kvrelay.server_tls import check_server_pair
from kvrelay.stopping import EXIT_FAST_STOP, FAST_STOP_SIGNALS

log = get_logger(__name__)

DEFAULT_GRACE_SECONDS = 10.0
# After a fast stop is forwarded: how long a child gets for its own fast stop (kill its ranks, free
# its pools, close its journal) before SIGKILL.
FAST_GRACE_SECONDS = 5.0
# A fast stop's SIGTERM goes again this often while a child runs: two signals sent moments apart
# may reach a process as one (a pending signal is not queued twice), which would leave it draining.
_FAST_RESEND_SECONDS = 1.0
DEFAULT_READY_TIMEOUT = 300.0
DEFAULT_BACKOFF_INITIAL = 1.0
DEFAULT_BACKOFF_MAX = 30.0
# A child that ran this long before exiting counts as healthy: its next restart starts the
# backoff from the beginning again.
DEFAULT_STABLE_SECONDS = 60.0
_POLL_SECONDS = 0.2
_LOG_TAIL_LINES = 30
# Once a child has been SERVING, its health is asked again this often: a replica turns NOT_SERVING
# while the broker refuses its credential, and a wedged process stops answering while it runs.
HEALTH_WATCH_SECONDS = 2.0
# This many unanswered checks in a row (each waits HEALTH_CHECK_TIMEOUT_S) count as "stopped
# answering": one slow answer on a loaded host does not. An answer other than SERVING counts at once.
UNANSWERED_CHECKS = 3
HEALTH_CHECK_TIMEOUT_S = 1.0
# How long registration and an advertised endpoint may take to show up once a replica is SERVING.
ADVERTISED_TIMEOUT_S = 10.0

_PR_SET_PDEATHSIG = 1
# A child exiting with this code met a configuration or deployment error (bad config, device
# missing, port taken, its replica already running elsewhere): starting it again would fail the
# same way, so the node stops instead of looping on restarts.
EXIT_CONFIG = 2


class SupervisorError(RuntimeError):
    """The node could not be brought up (a child exited or never became SERVING)."""


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One child process: how to start it and where its gRPC health answers."""

    name: str  # "broker", "ar-0", "dit-1"
    role: str  # "broker" | "ar" | "dit"
    argv: tuple[str, ...]
    address: str  # host:port of its gRPC server (health is checked here)
    metrics: str | None = None  # host:port of its Prometheus endpoint
    env: Mapping[str, str] = field(default_factory=dict)
    listens: tuple[Listen, ...] = ()  # the ports it binds (checked free before the node starts)


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A running child as the supervisor sees it."""

    name: str
    role: str
    pid: int | None
    address: str
    metrics: str | None
    serving: bool
    restarts: int
    # What its health has said since it stopped being SERVING ("NOT_SERVING", "not answering its
    # health check: DEADLINE_EXCEEDED"); None while SERVING, and while it starts.
    health_lost: str | None = None


@dataclass(eq=False)
class _Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    serving: bool = False
    restarts: int = 0
    failures: int = 0  # exits in a row without a stable run
    next_start_at: float | None = None
    log_file: IO[bytes] | None = None
    channel: grpc.Channel | None = None
    # The health watch of a SERVING child (`Node._watch_health`): reset at each start.
    next_watch_at: float = 0.0
    unanswered: int = 0
    health_lost: str | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


def _connect_host(host: str) -> str:
    """Where to reach a listener bound to `host` from this machine."""
    if host in ("", "0.0.0.0", "*"):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return host




def plan_children(
    config_path: str | os.PathLike[str],
    cfg: KvRelayConfig,
    *,
    host: str | None = None,
    command: Sequence[str] | None = None,
    roles: Sequence[str] = ("broker", "ar", "dit"),
    log_level: str | None = None,
    insecure_bind: bool = False,
) -> list[list[ChildSpec]]:
    """The node's children in start phases: [[broker], [every AR and DiT replica]].

    Ports set to 0 in the config are chosen here (free now) and passed with `--port` /
    `--metrics-port`, so the supervisor knows where to check health and a restarted child comes
    back on the same address. Replicas get `--broker` pointing at the broker chosen here.
    """
    prefix = tuple(command) if command is not None else (sys.executable, "-m", "kvrelay")
    cfg_arg = os.fspath(config_path)
    common: tuple[str, ...] = ("--log-level", log_level) if log_level else ()
    common += ("--insecure-bind",) if insecure_bind else ()
    taken: set[int] = set()

    broker_listen = host or cfg.broker.host
    broker_connect = _connect_host(broker_listen)
    broker_port = cfg.broker.port or pick_free_port(broker_connect, taken)
    broker_metrics = cfg.broker.metrics_port or pick_free_port(broker_connect, taken)
    broker_address = f"{broker_connect}:{broker_port}"
    phases: list[list[ChildSpec]] = []
    if "broker" in roles:
        argv = (*prefix, "broker", "--config", cfg_arg, "--port", str(broker_port))
        argv += ("--metrics-port", str(broker_metrics))
        argv += ("--host", host) if host else ()
        phases.append(
            [
                ChildSpec(
                    "broker", "broker", argv + common, broker_address, f"{broker_connect}:{broker_metrics}",
                    listens=(
                        Listen(broker_listen, broker_port, "broker gRPC", "broker.port"),
                        Listen(broker_listen, broker_metrics, "broker metrics", "broker.metrics_port"),
                    ),
                )  # fmt: skip
            ]
        )
    replicas: list[ChildSpec] = []
    for stage in (cfg.ar_stage, cfg.dit_stage):
        if stage.kind not in roles:
            continue
        connect = _connect_host(host or stage.host)
        for replica in range(stage.num_replicas):
            port = stage.port_for(replica) or pick_free_port(connect, taken)
            metrics = stage.metrics_port_for(replica) or pick_free_port(connect, taken)
            argv = (*prefix, stage.kind, "--config", cfg_arg, "--replica", str(replica))
            argv += ("--port", str(port), "--metrics-port", str(metrics), "--broker", broker_address)
            argv += ("--host", host) if host else ()
            replicas.append(
                ChildSpec(
                    f"{stage.kind}-{replica}",
                    stage.kind,
                    argv + common,
                    f"{connect}:{port}",
                    f"{connect}:{metrics}",
                    listens=(
                        Listen(host or stage.host, port, f"{stage.kind}-{replica} gRPC", f"port of the {stage.kind} stage"),
                        Listen(host or stage.host, metrics, f"{stage.kind}-{replica} metrics", f"metrics_port of the {stage.kind} stage"),
                    ),
                )
            )
    if replicas:
        phases.append(replicas)
    return phases


class Node:
    """A set of supervised child processes, started in phases.

    Usable as a context manager; `stop()` is idempotent and always leaves no child (nor any
    descendant of one) alive. All forking happens on the node's monitor thread.
    """

    def __init__(
        self,
        phases: Sequence[Sequence[ChildSpec]],
        *,
        log_dir: str | os.PathLike[str] | None = None,
        ready_timeout: float = DEFAULT_READY_TIMEOUT,
        grace: float = DEFAULT_GRACE_SECONDS,
        backoff_initial: float = DEFAULT_BACKOFF_INITIAL,
        backoff_max: float = DEFAULT_BACKOFF_MAX,
        stable_seconds: float = DEFAULT_STABLE_SECONDS,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        verify_advertised: bool = True,
        credentials: Credentials | None = None,
        health_watch_seconds: float = HEALTH_WATCH_SECONDS,
    ) -> None:
        self.verify_advertised = verify_advertised
        self.health_watch_seconds = health_watch_seconds
        # The node's credentials: health checks dial children with its TLS roots and certificate.
        self.credentials = credentials or Credentials()
        self._phases = [[_Child(spec) for spec in phase] for phase in phases]
        self._children = [c for phase in self._phases for c in phase]
        names = [c.spec.name for c in self._children]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique: {names}")
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.ready_timeout = ready_timeout
        self.grace = grace
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.stable_seconds = stable_seconds
        self._env = dict(env or {})
        self._cwd = os.fspath(cwd) if cwd is not None else None
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._idle = threading.Event()  # the monitor thread no longer touches children
        self._released = threading.Event()  # every child is stopped: the monitor thread may end
        self._hurry = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.fatal_error: str | None = None  # set when a child exits with a configuration error
        self._thread: threading.Thread | None = None
        self._stopped = False

    # -- public ---------------------------------------------------------------------------------

    def start(self) -> Node:
        """Start every phase in order and block until all children are SERVING.

        Raises SupervisorError (after stopping whatever was started) if a child exits or is not
        SERVING within `ready_timeout`.
        """
        if self._thread is not None:
            raise RuntimeError("node already started")
        # Before this process's first gRPC channel (its health checks of the children): a channel
        # to a child that stopped printed gRPC core's "Got goaway" line at every stop.
        quiet_grpc_core()
        try:
            check_ports_free(listen for child in self._children for listen in child.spec.listens)
        except PortInUse as err:
            raise SupervisorError(str(err)) from None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        # The monitor logs with the caller's bound context (e.g. process="up").
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="kvrelay-supervisor", daemon=True
        )
        self._thread.start()
        try:
            while not self._ready.wait(0.2):
                pass
            if self._startup_error is not None:
                raise self._startup_error
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float | None = None) -> None:
        """Stop every child: SIGTERM (replicas before the broker), wait, SIGKILL what is left."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._stopping.set()
        if self._thread is not None:
            # Wait until the monitor stops spawning; it stays alive (parked) until we are done.
            self._idle.wait(timeout=30)
        grace = self.grace if grace is None else grace
        try:
            for phase in reversed(self._phases):
                self._stop_children(phase, grace)
        finally:
            self._released.set()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=5)
        for child in self._children:
            self._close_channel(child)
            if child.log_file is not None:
                child.log_file.close()
                child.log_file = None
        log.info("node_stopped")

    def hurry(self) -> None:
        """Make a stop (in progress or to come) a fast one (a second Ctrl-C): every child still
        running gets a second SIGTERM, its own fast stop, and FAST_GRACE_SECONDS before SIGKILL."""
        self._hurry.set()

    @property
    def hurried(self) -> bool:
        return self._hurry.is_set()

    def processes(self) -> list[ProcessInfo]:
        with self._lock:
            return [
                ProcessInfo(
                    c.spec.name, c.spec.role, c.pid, c.spec.address, c.spec.metrics, c.serving, c.restarts,
                    c.health_lost,
                )
                for c in self._children
            ]

    def process(self, name: str) -> ProcessInfo:
        for info in self.processes():
            if info.name == name:
                return info
        raise KeyError(name)

    def address(self, role: str = "broker") -> str:
        """The gRPC address of the first child with this role (default: the broker)."""
        for child in self._children:
            if child.spec.role == role:
                return child.spec.address
        raise KeyError(role)

    def wait_serving(self, name: str, timeout: float, *, not_pid: int | None = None) -> ProcessInfo:
        """Wait until child `name` is SERVING (and, with `not_pid`, is a new process)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.process(name)
            if info.serving and info.pid is not None and info.pid != not_pid:
                return info
            time.sleep(0.05)
        raise TimeoutError(f"{name} not SERVING within {timeout}s: {self.process(name)}")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def describe(self) -> str:
        """A table of where things are."""
        rows = [("PROCESS", "PID", "ADDRESS", "METRICS", "STATE")]
        for p in self.processes():
            metrics = f"http://{p.metrics}/metrics" if p.metrics else "-"
            state = (p.health_lost or "SERVING") if p.serving else "starting"
            rows.append((p.name, str(p.pid or "-"), p.address, metrics, state))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
        )

    def __enter__(self) -> Node:
        if self._thread is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- the monitor thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._supervise()
        finally:
            self._idle.set()
            # Children die with the thread that forked them (PR_SET_PDEATHSIG): stay alive until
            # stop() has taken them down in order, or until this process itself ends.
            self._released.wait()

    def _supervise(self) -> None:
        try:
            self._start_phases()
        except BaseException as err:  # noqa: BLE001 - handed to the thread that called start()
            self._startup_error = err
            self._ready.set()
            return
        self._ready.set()
        if self._stopping.is_set():
            return
        log.info("node_serving", processes=len(self._children))
        while not self._stopping.wait(_POLL_SECONDS):
            for child in self._children:
                if self._stopping.is_set():
                    break
                try:
                    self._tend(child)
                except Exception:  # noqa: BLE001 - one bad pass (fork failed, EMFILE) must not end supervision
                    log.exception("supervise_failed", child=child.spec.name)
                    with self._lock:
                        if child.proc is None and child.next_start_at is None:
                            child.next_start_at = time.monotonic() + self.backoff_max

    def _start_phases(self) -> None:
        for phase in self._phases:
            for child in phase:
                self._spawn(child)
            deadline = time.monotonic() + self.ready_timeout
            pending = list(phase)
            while pending:
                if self._stopping.is_set():
                    return
                for child in list(pending):
                    assert child.proc is not None
                    code = child.proc.poll()
                    if code == EXIT_CONFIG:
                        raise SupervisorError(f"{child.spec.name}: {self._last_words(child)}")
                    if code is not None:
                        said = self._printed_reason(child)
                        if said is None and self.log_dir is None:
                            # Its `kvrelay dit: startup failed: ...` (a checkpoint that does not
                            # load) went to this process's stderr: say where, as _last_words does.
                            said = (f"its own `kvrelay {child.spec.role}: ...` line (why) is above on stderr; "
                                    "with --log-dir, kvrelay up repeats it here")  # fmt: skip
                        raise SupervisorError(
                            f"{child.spec.name} exited with code {code} before it was SERVING"
                            + (f": {said}" if said else "") + self._log_tail(child)
                        )
                    if self._check_serving(child):
                        with self._lock:
                            child.serving = True
                        log.info(
                            "child_serving", child=child.spec.name, pid=child.pid, address=child.spec.address
                        )
                        pending.remove(child)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(c.spec.name for c in pending)
                    # What to do: a model that loads for minutes (BAGEL-7B) is no failure.
                    raise SupervisorError(
                        f"not SERVING within {self.ready_timeout:g}s: {names} (still starting: loading a model, "
                        "registering page memory? a larger --ready-timeout waits longer; their logs say where "
                        "they are)" + self._log_tail(pending[0])
                    )
                if pending:
                    time.sleep(_POLL_SECONDS / 2)
        if self.verify_advertised and not self._stopping.is_set():
            self._verify_advertised()

    def _verify_advertised(self) -> None:
        """SERVING is not enough: every replica must be registered, and the endpoint it advertises
        (where the broker dials it) must answer from this host. A config whose advertise_host
        only resolves elsewhere (a compose service name) fails here, not on every generation."""
        broker = next((c for c in self._children if c.spec.role == "broker"), None)
        replicas = [c for c in self._children if c.spec.role in ("ar", "dit")]
        if broker is None or not replicas:
            return
        from kvrelay.v1 import broker_pb2, broker_pb2_grpc

        deadline = time.monotonic() + ADVERTISED_TIMEOUT_S
        while True:
            # ListReplicas is an operator RPC: the supervisor dials with the operator credential.
            with make_sync_channel(broker.spec.address, self.credentials.channel(CallerClass.OPERATOR)) as channel:
                try:
                    reply = broker_pb2_grpc.BrokerServiceStub(channel).ListReplicas(
                        broker_pb2.ListReplicasRequest(), timeout=5.0
                    )
                except grpc.RpcError as err:
                    if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                        log.warning("advertised_endpoints_unchecked", reason="no operator token in this environment")
                        return
                    raise SupervisorError(
                        f"the broker at {broker.spec.address} does not list its replicas: "
                        f"{err.code().name}: {err.details()}"
                    ) from None
            registered = {r.replica_id: r for r in reply.replicas}
            missing = [c.spec.name for c in replicas if c.spec.name not in registered]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise SupervisorError(
                    f"{', '.join(missing)} SERVING but not registered with the broker at {broker.spec.address}"
                )
            time.sleep(_POLL_SECONDS)
        for child in replicas:
            endpoint = registered[child.spec.name].endpoint
            problem = _health_problem(endpoint, max(1.0, deadline - time.monotonic()), self.credentials)
            if problem is not None:
                raise SupervisorError(
                    f"{child.spec.name} advertises {endpoint}, which does not answer from this host "
                    f"(where the broker dials it): {problem}; set its stage's advertise_host to an "
                    "address the broker can reach"
                )
            log.info("child_reachable", child=child.spec.name, endpoint=endpoint)

    def _tend(self, child: _Child) -> None:
        """One monitor pass over a child: notice an exit, restart when its backoff is over."""
        now = time.monotonic()
        if child.proc is not None:
            code = child.proc.poll()
            if code is None:
                if not child.serving and self._check_serving(child):
                    with self._lock:
                        child.serving = True
                    child.next_watch_at = now + self.health_watch_seconds
                    log.info("child_serving", child=child.spec.name, pid=child.pid, restarts=child.restarts)
                elif child.serving and now >= child.next_watch_at:
                    self._watch_health(child)
                    child.next_watch_at = time.monotonic() + self.health_watch_seconds
                return
            ran = now - child.started_at
            self._kill_leftovers(child.proc.pid)
            if code == EXIT_CONFIG:
                with self._lock:
                    child.proc = None
                    child.serving = False
                    self.fatal_error = f"{child.spec.name}: {self._last_words(child)}"
                log.error("child_config_error", child=child.spec.name, error=self.fatal_error)
                return
            if ran >= self.stable_seconds:
                child.failures = 0
            delay = min(self.backoff_max, self.backoff_initial * (2**child.failures))
            child.failures += 1
            with self._lock:
                child.proc = None
                child.serving = False
                child.next_start_at = now + delay
            log.warning(
                "child_exited",
                child=child.spec.name,
                returncode=code,
                ran_seconds=round(ran, 3),
                restart_in_seconds=round(delay, 3),
                failures_in_a_row=child.failures,
            )
            return
        if child.next_start_at is not None and now >= child.next_start_at:
            with self._lock:
                child.restarts += 1
                child.next_start_at = None
            self._spawn(child)
            log.info("child_restarted", child=child.spec.name, pid=child.pid, restarts=child.restarts)

    def _watch_health(self, child: _Child) -> None:
        """Ask a child that was SERVING for its health again; log one line when it stops being
        SERVING (an answer other than SERVING, or UNANSWERED_CHECKS unanswered checks in a row)
        and one when it is SERVING again: once per change, never a restart (the process runs; an
        exit is `_tend`'s). Without it, `kvrelay up` showed a replica the broker refused as SERVING."""
        status, error = self._health(child)
        if status == "SERVING":
            child.unanswered = 0
            if child.health_lost is not None:
                was = child.health_lost
                with self._lock:
                    child.health_lost = None
                log.info("child_serving_again", child=child.spec.name, pid=child.pid, was=was)
            return
        if status is None:
            child.unanswered += 1
            if child.unanswered < UNANSWERED_CHECKS:
                return
            what = f"not answering its health check: {error}"
        else:
            what = status
        if child.health_lost is not None:
            return  # reported when it stopped being SERVING; NOT_SERVING <-> unanswered is no news
        with self._lock:
            child.health_lost = what
        log.warning("child_not_serving", child=child.spec.name, pid=child.pid, health=what,
                    see=self._where_to_look(child, answered=status is not None))  # fmt: skip

    def _where_to_look(self, child: _Child, *, answered: bool) -> str:
        """Where a child's own account of its state is (its log, or this terminal), and what it
        may say."""
        if answered:
            why = "a replica is NOT_SERVING while its broker refuses its credential, and while it stops"
        else:
            why = "a process that runs but does not answer is stuck or starved of CPU"
        if self.log_dir is None:
            return f"its own lines above on stderr ({why})"
        return f"{self.log_dir / f'{child.spec.name}.log'} ({why})"

    # -- process handling -----------------------------------------------------------------------

    def _spawn(self, child: _Child) -> None:
        env = {**with_quiet_grpc_core(os.environ), "PYTHONUNBUFFERED": "1", **self._env, **child.spec.env}
        # Without a log folder, both of a child's streams go to this process's stderr: its stdout
        # is the node's report (`kvrelay up`'s table), which a child's "listening on" line (or
        # its whole JSON log) interleaved with, and `kvrelay up > node.txt` got it all.
        stdout: Any = sys.__stderr__.fileno() if sys.__stderr__ is not None else None
        if self.log_dir is not None:
            if child.log_file is None:
                child.log_file = open(self.log_dir / f"{child.spec.name}.log", "ab")  # noqa: SIM115
            # A JSON line like every other line of the child's log.
            banner = {"event": "child_starting", "child": child.spec.name, "level": "info",
                      "logger": "kvrelay.node.supervisor", "timestamp": _utc_now()}  # fmt: skip
            child.log_file.write(json.dumps(banner).encode() + b"\n")
            child.log_file.flush()
            stdout = child.log_file
        proc = subprocess.Popen(
            child.spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT if self.log_dir is not None else None,
            env=env,
            cwd=self._cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        with self._lock:
            child.proc = proc
            child.started_at = time.monotonic()
            child.serving = False
            child.health_lost = None
        child.unanswered = 0
        self._close_channel(child)
        log.info("child_started", child=child.spec.name, pid=proc.pid, argv=" ".join(child.spec.argv))

    def _check_serving(self, child: _Child) -> bool:
        return self._health(child)[0] == "SERVING"

    def _health(self, child: _Child) -> tuple[str | None, str]:
        """(the child's gRPC health status name, '') when it answers, else (None, the error)."""
        if child.channel is None:
            child.channel = make_sync_channel(child.spec.address, self.credentials.channel(CallerClass.PUBLIC))
        stub = health_pb2_grpc.HealthStub(child.channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_CHECK_TIMEOUT_S)
        except grpc.RpcError as err:
            # A channel that failed to connect waits out gRPC's reconnect backoff (seconds);
            # a fresh one notices a child that has just started listening at once.
            self._close_channel(child)
            code = err.code() if isinstance(err, grpc.Call) else None
            return None, code.name if code is not None else type(err).__name__
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status), ""

    @staticmethod
    def _close_channel(child: _Child) -> None:
        if child.channel is not None:
            child.channel.close()
            child.channel = None

    def _stop_children(self, children: Sequence[_Child], grace: float) -> None:
        live: list[tuple[_Child, subprocess.Popen[bytes], list[psutil.Process]]] = []
        for child in children:
            proc = child.proc
            if proc is None:
                continue
            descendants = _descendants(proc.pid)
            self._signal(proc, signal.SIGTERM)
            live.append((child, proc, descendants))
        first_sent = time.monotonic()
        deadline = first_sent + grace
        forwarded_at: float | None = None
        while any(proc.poll() is None for _, proc, _ in live) and time.monotonic() < deadline:
            now = time.monotonic()
            # The second SIGTERM no sooner than a moment after the first, so the two stay two.
            if self._hurry.is_set() and now - first_sent >= 0.1 and (
                forwarded_at is None or now - forwarded_at >= _FAST_RESEND_SECONDS
            ):
                if forwarded_at is None:
                    deadline = min(deadline, now + FAST_GRACE_SECONDS)
                    log.warning("fast_stop_forwarded", children=[c.spec.name for c, p, _ in live if p.poll() is None])
                forwarded_at = now
                for _, proc, _ in live:
                    self._signal(proc, signal.SIGTERM)
            time.sleep(0.05)
        for child, proc, descendants in live:
            if proc.poll() is None:
                log.warning("child_killed", child=child.spec.name, pid=proc.pid,
                            grace_seconds=FAST_GRACE_SECONDS if forwarded_at is not None else grace)
            else:
                log.info("child_stopped", child=child.spec.name, pid=proc.pid, returncode=proc.returncode)
            self._kill_leftovers(proc.pid, descendants)
            proc.wait()
            with self._lock:
                child.proc = None
                child.serving = False

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass

    @staticmethod
    def _kill_leftovers(pid: int, descendants: Sequence[psutil.Process] = ()) -> None:
        """SIGKILL the child's process group and every descendant seen earlier that still lives."""
        try:
            os.killpg(pid, signal.SIGKILL)  # the child is its session's (and group's) leader
        except (ProcessLookupError, PermissionError):
            pass
        for proc in [*descendants, *_descendants(pid)]:
            try:
                proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    def _last_words(self, child: _Child) -> str:
        """The one line a child printed about why it could not run (`kvrelay <role>: ...`)."""
        if self.log_dir is None:
            # Its line went to this process's stderr, where nothing here can read it back: say
            # where it is ("see its log" named no log at all; found walking the docs as a new user).
            where = (f"its own `kvrelay {child.spec.role}: ...` line is above on stderr; with --log-dir, "
                     "kvrelay up repeats it here")  # fmt: skip
        else:
            where = f"see {self.log_dir / f'{child.spec.name}.log'}"
        return self._printed_reason(child) or f"exited with code {EXIT_CONFIG} (a configuration error: {where})"

    def _printed_reason(self, child: _Child) -> str | None:
        """The last `kvrelay <role>: ...` line of a child's log (what it printed about why it
        stopped: a config error, a checkpoint that does not load), or None."""
        if self.log_dir is not None:
            try:
                tail = read_file_tail(self.log_dir / f"{child.spec.name}.log", LOG_TAIL_BYTES)
                lines = tail.decode(errors="replace").splitlines()
            except OSError:
                lines = []
            for line in reversed(lines[-200:]):
                if line.startswith("{"):
                    # A service process logs JSON: its printed lines are wrapped (native_output).
                    try:
                        line = str(json.loads(line).get("line", ""))
                    except (ValueError, AttributeError):
                        continue
                # `kvrelay ar: ...`, not `kvrelay ar listening on ...`.
                if line.startswith("kvrelay ") and line.split(" ", 2)[1].endswith(":"):
                    return line
        return None

    def _log_tail(self, child: _Child) -> str:
        if self.log_dir is None:
            return ""
        path = self.log_dir / f"{child.spec.name}.log"
        try:
            lines = read_file_tail(path, LOG_TAIL_BYTES).decode(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        except OSError:
            return ""
        return f"\n--- last lines of {path} ---\n" + "\n".join(lines)


def _health_problem(address: str, timeout_s: float, credentials: Credentials) -> str | None:
    """None when `address` answers gRPC health SERVING, else what went wrong."""
    with make_sync_channel(address, credentials.channel(CallerClass.PUBLIC)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, wait_for_ready=False
            )
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def _utc_now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    """In the forked child, before exec: SIGHUP when the supervisor's monitor thread dies (sent
    again at each reparenting, so not SIGTERM: two of those are a fast stop, kvrelay/stopping.py)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGHUP, 0, 0, 0)


def build_node(
    config_path: str | os.PathLike[str],
    *,
    cfg: KvRelayConfig | None = None,
    host: str | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    command: Sequence[str] | None = None,
    roles: Sequence[str] = ("broker", "ar", "dit"),
    log_level: str | None = None,
    insecure_bind: bool = False,
    **node_options: Any,
) -> Node:
    """A Node for a config, not yet started (see `plan_children` for what it will run)."""
    cfg = cfg if cfg is not None else load_config(config_path)
    phases = plan_children(
        config_path, cfg, host=host, command=command, roles=roles, log_level=log_level, insecure_bind=insecure_bind
    )
    node_options.setdefault("credentials", load_credentials(cfg.security))
    # Bound replica tokens: each child gets its own credential (the broker the secret).
    token_env = node_token_env(cfg.security, [c.name for phase in phases for c in phase])
    if token_env:
        phases = [[replace(c, env={**c.env, **token_env[c.name]}) for c in phase] for phase in phases]
    node_options["env"] = {**cpu_share_env(cfg, roles), **dict(node_options.get("env") or {})}
    # Our own services register with the broker; other commands (test doubles) may not.
    node_options.setdefault("verify_advertised", command is None)
    return Node(phases, log_dir=log_dir, **node_options)


def cpu_share_env(cfg: KvRelayConfig, roles: Sequence[str] = ("broker", "ar", "dit")) -> dict[str, str]:
    """Torch threads per rank when the node's CPU ranks share this host's cores.

    The ranks of one stage (its replicas x world size) compute at the same time and split the
    cores; the AR and DiT stages take turns (a request's prefill, then its denoise), so each
    stage gets every core, and rank workers wait for work passively (worker.py sets
    OMP_WAIT_POLICY=PASSIVE) so the idle stage gives its cores back. Splitting the cores between
    the stages instead left the DiT, the stage with nearly all the work, half of a 2-core host
    (served vs colocated before and after: benchmarks/README.md). Each rank worker
    would otherwise take cores / (its replica's ranks), ignoring the stage's other replicas.
    An explicit KVRELAY_THREADS_PER_RANK in the environment wins.
    """
    if os.environ.get("KVRELAY_THREADS_PER_RANK"):
        return {}
    ranks = max(
        (
            stage.world_size * stage.num_replicas
            for stage in (cfg.ar_stage, cfg.dit_stage)
            if stage.kind in roles and stage.device_list() == ["cpu"]
        ),
        default=0,
    )
    if ranks == 0:
        return {}
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return {"KVRELAY_THREADS_PER_RANK": str(max(1, cores // ranks))}


def start_node(
    config_path: str | os.PathLike[str],
    *,
    host: str | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    command: Sequence[str] | None = None,
    roles: Sequence[str] = ("broker", "ar", "dit"),
    log_level: str | None = None,
    **node_options: Any,
) -> Node:
    """Start a node for a config and return it once every child is SERVING.

    ``with start_node("tests/configs/test-fast.yaml", log_dir=tmp) as node:`` then talk to
    ``node.address()`` (the broker); leaving the block stops everything.
    """
    node = build_node(
        config_path,
        host=host,
        log_dir=log_dir,
        command=command,
        roles=roles,
        log_level=log_level,
        **node_options,
    )
    return node.start()


class _StopRequested(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def config_snapshot(config_path: str | os.PathLike[str]) -> Path:
    """A private copy of the config file `config_path` names (shipped names resolved as
    load_config does), in a new temporary folder: what every child of `kvrelay up` is started and
    restarted with. The children read the file the command line named before: one restarted after
    an edit (a crash, a fail-stop) ran the edited file beside a broker and replicas still on the old
    one, and an invalid edit made it exit 2, which stopped the whole serving node (found
    black-box). Relative paths inside a config are taken from the working directory, not the
    config's folder, so the copy means the same."""
    from kvrelay.resources import resolve

    source = resolve(config_path, "configs")
    folder = Path(tempfile.mkdtemp(prefix="kvrelay-up-"))
    copy = folder / (source.name or "config.yaml")
    try:
        copy.write_bytes(read_bounded_file(source, MAX_CONFIG_FILE_BYTES, "YAML config"))
    except (OSError, FileRefused):
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return copy


def run_up(args: argparse.Namespace, *, command: Sequence[str] | None = None) -> int:
    """`kvrelay up`: start the node of `args.config`, report where it is, supervise until a signal."""
    log_level = getattr(args, "log_level", None)
    configure_logging(log_level, process="up")
    config_path = getattr(args, "config", None) or default_config_path()
    try:
        load_config(config_path)  # its errors name the file as given
        snapshot = config_snapshot(config_path)
    except ConfigError as err:
        print(f"kvrelay up: {err}", file=sys.stderr)
        return 2
    except FileRefused as err:  # replaced since load_config read it
        print(f"kvrelay up: config {config_path}: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"kvrelay up: cannot copy the config {config_path}: {err.strerror or err}", file=sys.stderr)
        return 1
    try:
        return _run_up(args, command, log_level, config_path, snapshot)
    finally:
        shutil.rmtree(snapshot.parent, ignore_errors=True)


def _check_tls_pairs(cfg: KvRelayConfig) -> None:
    """Raise SecurityError naming the process, its files and why unless every process's TLS pair
    (`tls.cert_file`/`tls.key_file` with `{name}` = broker, ar-N, dit-N) is one a peer trusting
    `tls.ca_file` accepts. Found black-box: a DiT with an expired certificate started, never
    registered (its broker refused the handshake), logged no warning, and `kvrelay up` waited for
    its ready timeout printing gRPC C-core handshake errors, several a second."""
    if cfg.security.tls is None:
        return
    names = [BROKER_CALLER_ID]
    names += [f"ar-{i}" for i in range(cfg.ar_stage.num_replicas)]
    names += [f"dit-{i}" for i in range(cfg.dit_stage.num_replicas)]
    for name in names:
        tls = read_tls(cfg.security, name)
        if tls is not None:
            check_server_pair(tls, f"{name}: {tls_files(cfg.security, name)}")


def _run_up(
    args: argparse.Namespace,
    command: Sequence[str] | None,
    log_level: str | None,
    config_path: str | os.PathLike[str],
    snapshot: Path,
) -> int:
    try:
        cfg = load_config(snapshot)
        creds = load_credentials(cfg.security)
        # Refused here once rather than by every child in a restart loop.
        listens = {"broker.host": cfg.broker.host, "stages[0].host": cfg.ar_stage.host, "stages[1].host": cfg.dit_stage.host}
        if getattr(args, "host", None):
            listens = {"--host": args.host}
        for key, listen in listens.items():
            # `what` names the setting: the line is printed after "kvrelay up: " already.
            check_bind(listen, creds, bool(getattr(args, "insecure_bind", False)), key)
        _check_tls_pairs(cfg)
    except (ConfigError, SecurityError) as err:
        print(f"kvrelay up: {err}", file=sys.stderr)
        return 2
    log_dir = getattr(args, "log_dir", None)
    if log_dir:
        # Made here, so that a folder that cannot be is one line before anything starts.
        try:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            print(f"kvrelay up: --log-dir {log_dir}: {err.strerror or err}", file=sys.stderr)
            return 2
    # The node metrics port is bound before the children's ports are chosen: a port 0 bound after
    # them could be given one of theirs (just probed free), and the node would refuse to start on
    # its own listener.
    built: list[Node] = []
    metrics_host = getattr(args, "host", None) or cfg.broker.host
    metrics_port = int(getattr(args, "metrics_port", None) or 0)
    try:
        metrics = NodeMetricsServer(
            lambda: {p.name: f"http://{p.metrics}/metrics" for n in built for p in n.processes() if p.metrics},
            host=metrics_host,
            port=metrics_port,
        )
    except OSError as err:
        if metrics_port and not is_port_free(metrics_host, metrics_port):
            print(f"kvrelay up: {in_use_message(metrics_port, 'node metrics', metrics_host)}: stop it, or pass "
                  "another --metrics-port (0 = any free port)", file=sys.stderr)  # fmt: skip
        else:
            print(f"kvrelay up: node metrics on {metrics_host}:{metrics_port}: {err}", file=sys.stderr)
        return 1
    try:
        node = build_node(
            snapshot,
            cfg=cfg,
            host=getattr(args, "host", None),
            log_dir=getattr(args, "log_dir", None),
            command=command,
            log_level=log_level,
            insecure_bind=bool(getattr(args, "insecure_bind", False)),
            ready_timeout=float(getattr(args, "ready_timeout", None) or DEFAULT_READY_TIMEOUT),
        )
    except SecurityError as err:
        metrics.stop()
        print(f"kvrelay up: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        metrics.stop()
        print(f"kvrelay up: {err}", file=sys.stderr)
        return 1
    built.append(node)

    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            if signum in FAST_STOP_SIGNALS and not node.hurried:
                name = signal.Signals(signum).name
                log.warning("fast_stop_requested", signal=name)
                node.hurry()
                # After the act: on a closed terminal the line fails (EIO), and raised in this
                # handler it would break off whatever the main thread was doing (the stop).
                with contextlib.suppress(OSError, ValueError):
                    print(f"kvrelay up: {name} again: fast stop: forwarding it to every process, "
                          f"{FAST_GRACE_SECONDS:g} s each before SIGKILL, exit {EXIT_FAST_STOP}",
                          file=sys.stderr, flush=True)
            return
        stopping = True
        raise _StopRequested(signum)

    def on_stopping() -> None:
        # A signal from now on finds the node stopping: it makes the stop fast, nothing more.
        nonlocal stopping
        stopping = True

    metrics.start()
    # SIGHUP (the terminal or SSH session went away) stops the node in order too: by default it
    # would kill this process outright and leave the children to PDEATHSIG, all at once.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    hint = try_command(cfg, node.address(), api_token=creds.api_token is not None)
    code = _supervise_until_stopped(node, config_path, metrics, metrics_host, previous, on_stopping, hint)
    return EXIT_FAST_STOP if node.hurried else code


# What the demo model draws (docs/bagel.md), with the settings README's quick start uses: any
# other prompt, or 2 steps, gives it a blur of one colour, and the `try:` line suggested a fox.
DEMO_TRY = ('"a red circle on a blue background, top left"', "--steps 8 --guidance-scale 3.0")
# The variable `kvrelay generate` reads its token from when --token is not given.
API_TOKEN_ENV = "KVRELAY_API_TOKEN"


def try_command(cfg: KvRelayConfig, address: str, *, api_token: bool = False) -> str:
    """The `kvrelay generate` that `kvrelay up` suggests once the node serves: one that works on
    this node from the same shell as it stands: a prompt the demo model draws, and the TLS roots
    and api token that a node with `security:` set asks for (the CLI reads `$KVRELAY_API_TOKEN`
    itself; a token from a file or another variable must be passed)."""
    prompt, flags = DEMO_TRY if cfg.dit_stage.model.format == "demo" else ('"a red fox in the snow"', "")
    words = [prompt, flags] if flags else [prompt]
    sec = cfg.security
    if api_token and sec.api_token_file:
        words.append(f'--token "$(cat {shlex.quote(sec.api_token_file)})"')
    elif api_token and sec.api_token_env and sec.api_token_env != API_TOKEN_ENV:
        words.append(f'--token "${sec.api_token_env}"')
    if sec.tls is not None:
        words.append(f"--tls-ca {shlex.quote(sec.tls.ca_file)}")
        if sec.tls.require_client_cert:
            words.append("--tls-cert CERT.pem --tls-key KEY.pem")
    return f"kvrelay generate {' '.join(words)} --target {address}"


def _supervise_until_stopped(
    node: Node,
    config_path: str | os.PathLike[str],
    metrics: NodeMetricsServer,
    metrics_host: str,
    previous: dict[signal.Signals, Any],
    on_stopping: Callable[[], None],
    try_line: str,
) -> int:
    """`kvrelay up` from the start of the node to its stop; the exit code of a stop that no second
    signal made fast."""
    up = False
    try:
        try:
            node.start()
        except SupervisorError as err:
            print(f"kvrelay up: {err}", file=sys.stderr)
            return 1
        up = True
        print(f"kvrelay up: every process is SERVING (config {config_path})", flush=True)
        print(node.describe(), flush=True)
        print(
            f"node metrics (every process, label process): http://{_connect_host(metrics_host)}:{metrics.port}/metrics",
            flush=True,
        )
        print(
            f"try: {try_line}   (Ctrl-C here stops everything)",
            flush=True,
        )
        while node.fatal_error is None:
            time.sleep(1.0)
        print(f"kvrelay up: {node.fatal_error}; stopping the node", file=sys.stderr, flush=True)
        return 1
    except _StopRequested as request:
        log.info("stop_requested", signal=signal.Signals(request.signum).name)
        with contextlib.suppress(OSError, ValueError):  # a terminal that went away (SIGHUP) takes no line
            print(f"kvrelay up: {signal.Signals(request.signum).name}: stopping", file=sys.stderr, flush=True)
        # Stopped on request once up: a clean exit. Interrupted while starting: 130, like Ctrl-C.
        return 0 if up else 130
    finally:
        on_stopping()
        node.stop()
        metrics.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


__all__ = [
    "ChildSpec",
    "Node",
    "ProcessInfo",
    "SupervisorError",
    "build_node",
    "plan_children",
    "run_up",
    "start_node",
]
