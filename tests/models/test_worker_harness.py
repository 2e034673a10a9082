"""The rank worker harness with real processes: errors, deaths, thread shares, PDEATHSIG and the
replica lock."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from kvrelay.worker import (
    LockTimeout,
    ReplicaLock,
    WorkerCommandError,
    WorkerDied,
    WorkerGroup,
    WorkerGroupBroken,
    WorkerStalled,
    WorkerTimeout,
    WorkerUnresponsive,
    collective_timeout_s,
    default_threads_per_rank,
    deployment_key,
    overdue_ranks,
    replica_lock_path,
    watch_ranks,
)
from tests.models.rank_handlers import (
    ExitNow,
    Explode,
    Info,
    ModelsTestHandler,
    Sleep,
    WedgeCommandLoop,
    failing_factory,
)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return all(_gone(p) for p in pids)


def test_lock_excludes_a_second_holder_until_released(tmp_path):
    path = tmp_path / "locks" / "ar-0.lock"
    first = ReplicaLock(path).acquire()
    with pytest.raises(LockTimeout, match=f"pid {os.getpid()}"):
        ReplicaLock(path).acquire(timeout_s=0.2)
    first.release()
    second = ReplicaLock(path).acquire(timeout_s=1.0)
    assert second.held
    second.release()


def test_a_lock_folder_that_cannot_be_made_names_kvrelay_lock_dir(tmp_path, monkeypatch):
    """Found black-box: `KVRELAY_LOCK_DIR` naming a file (or a folder that cannot be created) made
    `kvrelay dit` exit with `kvrelay dit: /path/local_47310: Not a directory`, a path the user
    never typed and no word of the setting. The error (an OSError the CLI prints in one line,
    exit 2) now says it is the replica lock and which setting to change."""
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("KVRELAY_LOCK_DIR", str(afile))
    with pytest.raises(NotADirectoryError) as info:
        ReplicaLock(replica_lock_path("dit-1", deployment="127.0.0.1:47310")).acquire()
    err = info.value
    assert err.filename.startswith(str(afile)) and err.filename.endswith("dit-1.lock")
    assert "replica lock" in err.strerror and f"KVRELAY_LOCK_DIR={afile}" in err.strerror, err.strerror
    assert err.strerror.startswith("Not a directory")


def test_the_lock_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    """A second `kvrelay ar --replica 0` of the same deployment started from another folder must
    wait for the first one's lock: its registration would otherwise pass for proof that the first
    incarnation is gone while it runs (a relative `.kvrelay/locks` let exactly that happen)."""
    import uuid

    monkeypatch.delenv("KVRELAY_LOCK_DIR", raising=False)
    deployment = f"127.0.0.1:{uuid.uuid4().hex[:8]}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    first_path = replica_lock_path("ar-0", deployment=deployment)
    assert first_path.is_absolute()
    first = ReplicaLock(first_path).acquire()
    try:
        monkeypatch.chdir(tmp_path / "b")
        assert replica_lock_path("ar-0", deployment=deployment) == first_path
        with pytest.raises(LockTimeout):
            ReplicaLock(replica_lock_path("ar-0", deployment=deployment)).acquire(timeout_s=0.2)
    finally:
        first.release()
        first_path.unlink(missing_ok=True)
        first_path.parent.rmdir()
    # $KVRELAY_LOCK_DIR moves every lock of the host (an absolute folder, whatever the cwd).
    monkeypatch.setenv("KVRELAY_LOCK_DIR", "locks-here")
    assert replica_lock_path("dit-1", deployment="h:1") == (tmp_path / "b" / "locks-here" / "h_1" / "dit-1.lock")


def test_every_spelling_of_one_broker_takes_the_same_replica_lock(tmp_path):
    """The lock is keyed by the deployment, not by how `--broker` was typed: `localhost:P` and
    `127.0.0.1:P` (and the other local spellings) must exclude each other."""
    import socket

    port = 50999
    spellings = [
        f"localhost:{port}", f"127.0.0.1:{port}", f"0.0.0.0:{port}", f"dns:///localhost:{port}",
        f"ipv4:127.0.0.1:{port}", f"{socket.gethostname()}:{port}", f" LOCALHOST:{port} ",
    ]
    if socket.has_ipv6:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            spellings += [f"[::1]:{port}", f"ipv6:[::1]:{port}"]
    assert {deployment_key(s) for s in spellings} == {f"local:{port}"}
    assert deployment_key("localhost") == "local:443"  # gRPC's port for a target without one
    assert deployment_key(f"localhost:{port + 1}") != deployment_key(f"localhost:{port}")
    assert deployment_key("no-such-host.invalid:7") == "no-such-host.invalid:7"
    assert deployment_key("192.0.2.7:7") == "192.0.2.7:7"  # TEST-NET-1: not an address of this host
    paths = {replica_lock_path("dit-0", tmp_path, deployment=s) for s in spellings}
    assert len(paths) == 1
    (path,) = paths
    first = ReplicaLock(path).acquire()
    try:
        with pytest.raises(LockTimeout, match=f"by pid {os.getpid()} \\(running\\)") as info:
            ReplicaLock(replica_lock_path("dit-0", tmp_path, deployment=f"localhost:{port}")).acquire(timeout_s=0.1)
        assert info.value.holder_pid == os.getpid() and "\n" not in str(info.value)
    finally:
        first.release()


@pytest.mark.slow
def test_handler_errors_come_back_typed_and_the_group_stays_usable():
    with WorkerGroup(2, ModelsTestHandler) as group:
        with pytest.raises(WorkerCommandError) as info:
            group.call_all(Explode("bad prompt"))
        assert [e.rank for e in info.value.errors] == [0, 1]
        assert isinstance(info.value.first_exception, ValueError)
        assert "bad prompt" in str(info.value.first_exception)
        # Every rank answered, so the next command works.
        pids_threads = group.call_all(Info())
        share = default_threads_per_rank(2)
        assert [t for _, t, _, _ in pids_threads] == [share, share]
        assert [omp for _, _, omp, _ in pids_threads] == [str(share), str(share)]
        assert [p for p, _, _, _ in pids_threads] == group.pids
        # CPU ranks wait for work passively unless the environment says otherwise: an idle
        # spinning pool would take the cores from the other stage on a shared host.
        if "OMP_WAIT_POLICY" not in os.environ:
            assert [wait for _, _, _, wait in pids_threads] == ["PASSIVE", "PASSIVE"]
        # A rank that dies is reported with its rank and exit code; the rest are stopped.
        with pytest.raises(WorkerDied, match=r"rank \d died \(exit code 7\)") as died:
            group.call_each([Sleep(0.0), ExitNow(7)])
        assert died.value.rank == 1 and died.value.exitcode == 7
        assert _wait_gone(group.pids, 5.0)
        with pytest.raises(WorkerGroupBroken):
            group.call_all(Info())


@pytest.mark.slow
def test_a_rank_that_does_not_answer_times_out_and_the_group_is_stopped():
    group = WorkerGroup(1, ModelsTestHandler)
    group.start()
    try:
        with pytest.raises(WorkerTimeout):
            group.call_all(Sleep(30.0), timeout_s=0.5)
        assert _wait_gone(group.pids, 5.0)
    finally:
        group.stop()


@pytest.mark.slow
def test_stop_does_not_wait_forever_for_a_command_in_flight():
    group = WorkerGroup(2, ModelsTestHandler)
    group.start()
    outcome: list[BaseException] = []

    def busy() -> None:
        try:
            group.call_all(Sleep(60.0))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    caller = threading.Thread(target=busy)
    caller.start()
    time.sleep(0.3)
    started = time.monotonic()
    group.stop(timeout_s=0.5)
    caller.join(10.0)
    assert time.monotonic() - started < 8.0
    assert len(outcome) == 1 and isinstance(outcome[0], WorkerDied), outcome
    assert _wait_gone(group.pids, 5.0)


@pytest.mark.slow
def test_a_rank_stopped_in_the_middle_of_a_command_is_found_and_the_group_killed(tmp_path):
    """A SIGSTOPped rank answers nothing and never dies: a command without a deadline (a whole
    denoise, a prefill) would wait for it forever, and a ping waits behind that command. Its
    liveness beat stops with it: check_alive kills the group (lock released, every rank gone)
    and the command in flight raises WorkerStalled."""
    path = tmp_path / "dit-0.lock"
    lock = ReplicaLock(path).acquire()
    group = WorkerGroup(2, ModelsTestHandler, lock=lock, beat_interval_s=0.05)
    group.start()
    outcome: list[BaseException] = []

    def busy() -> None:
        try:
            group.call_all(Sleep(120.0))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    caller = threading.Thread(target=busy)
    try:
        caller.start()
        time.sleep(0.5)
        group.check_alive(1.0)  # both ranks beat while the command runs: nothing to find
        lock.release()
        os.kill(group.pids[1], signal.SIGSTOP)
        deadline = time.monotonic() + 10.0
        with pytest.raises(WorkerStalled, match=r"rank 1 silent .*process state T") as info:
            while time.monotonic() < deadline:
                group.check_alive(1.0)
                time.sleep(0.1)
        assert info.value.ranks == (1,)
        caller.join(10.0)
        assert len(outcome) == 1 and isinstance(outcome[0], WorkerStalled), outcome
        assert _wait_gone(group.pids, 5.0)
        ReplicaLock(path).acquire(timeout_s=5.0).release()
        with pytest.raises(WorkerGroupBroken):
            group.check_alive(1.0)
    finally:
        for pid in group.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        group.stop()


@pytest.mark.slow
def test_silence_counts_only_while_the_caller_watched():
    """A whole replica paused and continued (service and ranks stopped together): the watchdog
    wakes up to stale beats of ranks that were not scheduled yet. Silence before the watch
    (re)started is not blamed on them."""
    group = WorkerGroup(1, ModelsTestHandler, beat_interval_s=0.05)
    group.start()
    try:
        os.kill(group.pids[0], signal.SIGSTOP)
        time.sleep(1.5)
        group.check_alive(1.0, observed_since=time.monotonic() - 0.5)  # silent 1.5 s, watched 0.5 s
        os.kill(group.pids[0], signal.SIGCONT)
        time.sleep(0.5)
        group.check_alive(1.0)  # beating again
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(group.pids[0], signal.SIGCONT)
        group.stop()


async def _watch_until_lost(group: WorkerGroup, fault: int, lost: list[str]) -> None:
    watchdog = asyncio.ensure_future(
        watch_ranks(group, lost.append, interval_s=0.1, max_silence_s=1.0)
    )
    await asyncio.sleep(0.5)
    assert not lost and not watchdog.done()
    os.kill(group.pids[0], fault)
    await asyncio.wait_for(watchdog, 10.0)


@pytest.mark.slow
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["died", "stopped"])
def test_the_watchdog_reports_an_idle_rank_that_died_or_stopped(fault: int) -> None:
    group = WorkerGroup(1, ModelsTestHandler, beat_interval_s=0.05)
    group.start()
    lost: list[str] = []
    try:
        asyncio.run(_watch_until_lost(group, fault, lost))
        assert len(lost) == 1
        assert ("died" if fault == signal.SIGKILL else "silent") in lost[0], lost
        assert _wait_gone(group.pids, 5.0)
    finally:
        for pid in group.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        group.stop()


def test_a_ping_unanswered_under_the_stall_limit_is_tolerated_however_long():
    """The watchdog's Ping has no limit of its own (it was a fixed 30 s, so a rank_stall_seconds
    above 30 did not tolerate a longer stop): unanswered for 31 s or 74 s under a 75 s limit is
    fine, past the limit the ranks that owe the answer are hung."""
    assert overdue_ranks([0.2, 0.3], 31.0, [0, 1], 75.0) is None
    assert overdue_ranks([0.2, 0.3], 74.9, [1], 75.0) is None
    assert overdue_ranks([0.2, 0.3], 75.5, [1], 75.0) == (WorkerUnresponsive, [1], [75.5])
    assert overdue_ranks([0.2], 3.0, [0], 2.0) == (WorkerUnresponsive, [0], [3.0])  # a short limit: short
    assert overdue_ranks([0.2, 0.3], None, [], 75.0) is None  # none sent (or waiting behind a command)


def test_a_silent_beat_is_reported_before_the_ping_it_left_unanswered():
    assert overdue_ranks([0.1, 9.0], 8.5, [1], 4.0) == (WorkerStalled, [1], [9.0])
    assert overdue_ranks([4.5, 0.1, 6.0], None, [], 4.0) == (WorkerStalled, [0, 2], [4.5, 6.0])
    assert overdue_ranks([4.0, 3.9], 4.0, [0, 1], 4.0) is None  # at the limit, not over it


def test_what_happened_while_the_watcher_itself_was_stopped_is_not_counted():
    # The whole replica paused 60 s and continued: beats and the Ping's answer are not in yet.
    assert overdue_ranks([60.0], 60.0, [0], 10.0, watched_s=1.0) is None
    assert overdue_ranks([60.0], None, [], 10.0, watched_s=11.0) == (WorkerStalled, [0], [11.0])
    assert overdue_ranks([0.1], 60.0, [0], 10.0, watched_s=11.0) == (WorkerUnresponsive, [0], [11.0])


def test_collectives_wait_out_a_stop_under_the_stall_limit():
    """A peer stopped mid-collective for less than the limit must not time the others out first
    (their command fails, and the replica with it): the collective timeout grows with the limit."""
    assert collective_timeout_s(10.0) == 310.0
    for limit in (2.0, 75.0, 300.0, 3600.0):
        assert collective_timeout_s(limit) >= 300.0 + limit


async def _stop_for(pid: int, watchdog: asyncio.Future[None], group: WorkerGroup, unanswered_s: float) -> float:
    """SIGSTOP `pid` until the watchdog's Ping has been unanswered `unanswered_s`, then SIGCONT;
    return how long the Ping was left unanswered."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + unanswered_s + 20.0
        longest = 0.0
        while longest < unanswered_s and time.monotonic() < deadline and not watchdog.done():
            longest = max(longest, group.ping_unanswered_s() or 0.0)
            await asyncio.sleep(0.02)
        return longest
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed by the watchdog
            os.kill(pid, signal.SIGCONT)


STALL_S = 6.0  # the stall limit of the stop test: every stop under it (2.5 s) is tolerated
OLD_PING_S = 2.5  # a stop that leaves the Ping unanswered this long: past a Ping with a shorter fixed limit


async def _stop_under_then_over_the_limit(group: WorkerGroup, lost: list[str]) -> None:
    watchdog = asyncio.ensure_future(
        watch_ranks(group, lost.append, interval_s=0.1, max_silence_s=STALL_S)
    )
    try:
        unanswered = await _stop_for(group.pids[0], watchdog, group, OLD_PING_S)
        assert not lost and unanswered >= OLD_PING_S, (lost, unanswered)
        # Continued: the Ping is answered, the group runs commands, the watchdog watches on.
        deadline = time.monotonic() + 20.0
        while group.ping_unanswered_s() is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert await asyncio.to_thread(group.call_all, Info(), 30.0)
        assert await asyncio.to_thread(group.ping, 30.0)
        assert not lost and not watchdog.done(), lost
        # Past the limit: the replica fail-stops (the beat is silent first, named as such).
        os.kill(group.pids[0], signal.SIGSTOP)
        await asyncio.wait_for(watchdog, STALL_S + 20.0)
    finally:
        for pid in group.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if not watchdog.done():
            watchdog.cancel()


@pytest.mark.slow
def test_a_stop_under_the_stall_limit_is_tolerated_and_one_over_it_fail_stops() -> None:
    """A rank SIGSTOPped while idle leaves the watchdog's Ping unanswered. With a fixed Ping limit
    under rank_stall_seconds (30 s before) that stop fail-stopped the replica too early; now the
    stall limit is the one limit: a stop under it is tolerated (the group serves on after SIGCONT),
    one over it kills the group."""
    group = WorkerGroup(1, ModelsTestHandler, beat_interval_s=0.05)
    group.start()
    lost: list[str] = []
    try:
        asyncio.run(_stop_under_then_over_the_limit(group, lost))
        assert len(lost) == 1 and "rank 0 silent" in lost[0] and f"over the {STALL_S:.1f}s limit" in lost[0], lost
        assert _wait_gone(group.pids, 5.0)
    finally:
        for pid in group.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        group.stop()


async def _wedge_until_lost(group: WorkerGroup, lost: list[str]) -> None:
    await asyncio.to_thread(group.call_all, WedgeCommandLoop(120.0), 30.0)
    watchdog = asyncio.ensure_future(watch_ranks(group, lost.append, interval_s=0.1, max_silence_s=2.0))
    try:
        await asyncio.wait_for(watchdog, 30.0)
    finally:
        group.kill()  # (killed already, unless this failed) ends the Ping's thread: it has no deadline


@pytest.mark.slow
def test_a_rank_whose_beat_runs_but_whose_command_loop_hangs_fail_stops_at_the_same_limit() -> None:
    group = WorkerGroup(2, ModelsTestHandler, beat_interval_s=0.05)
    group.start()
    lost: list[str] = []
    try:
        asyncio.run(_wedge_until_lost(group, lost))
        assert len(lost) == 1, lost
        assert "did not answer a Ping for" in lost[0] and "over the 2.0s limit, hung" in lost[0], lost
        assert "rank 0" in lost[0] and "rank 1" in lost[0], lost
        assert _wait_gone(group.pids, 5.0)
    finally:
        group.stop()


@pytest.mark.slow
def test_a_failing_factory_fails_start_with_the_rank_error():
    group = WorkerGroup(2, failing_factory, start_timeout_s=60.0)
    with pytest.raises(WorkerCommandError, match="rank 1 cannot load its weights") as info:
        group.start()
    # The phase by its name (what `kvrelay up` shows a user), not an internal placeholder class.
    assert str(info.value).startswith("startup failed on rank(s) [1]: "), str(info.value)[:200]
    assert _wait_gone(group.pids, 5.0)


@pytest.mark.slow
def test_workers_hold_the_replica_lock_until_they_exit(tmp_path):
    path = tmp_path / "dit-0.lock"
    lock = ReplicaLock(path).acquire()
    group = WorkerGroup(2, ModelsTestHandler, lock=lock)
    group.start()
    try:
        lock.release()  # the service's own descriptor is gone; the workers still hold the lock
        with pytest.raises(LockTimeout):
            ReplicaLock(path).acquire(timeout_s=0.3)
    finally:
        group.stop()
    ReplicaLock(path).acquire(timeout_s=5.0).release()


_PARENT = textwrap.dedent(
    """
    import sys
    from kvrelay.worker import ReplicaLock, WorkerGroup
    from tests.models.rank_handlers import ModelsTestHandler, Sleep

    if __name__ == "__main__":
        lock = ReplicaLock(sys.argv[1]).acquire()
        group = WorkerGroup(2, ModelsTestHandler, lock=lock)
        group.start()
        print(" ".join(str(p) for p in group.pids), flush=True)
        # Busy ranks: they would not notice the closed pipe, only PDEATHSIG can stop them.
        group.call_all(Sleep(120))
    """
)


@pytest.mark.slow
def test_sigkill_of_the_parent_leaves_no_worker_alive_and_frees_the_lock(tmp_path, repo_root):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    lock_path = tmp_path / "ar-0.lock"
    parent = subprocess.Popen(
        [sys.executable, str(script), str(lock_path)],
        cwd=repo_root,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
    )
    try:
        line = parent.stdout.readline()
        worker_pids = [int(p) for p in line.split()]
        assert len(worker_pids) == 2, line
        assert not any(_gone(p) for p in worker_pids)
        with pytest.raises(LockTimeout):
            ReplicaLock(lock_path).acquire(timeout_s=0.2)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _wait_gone(worker_pids, 5.0), "worker ranks outlived their parent"
        # The new incarnation can take the lock: proof that no process of the old one is alive.
        ReplicaLock(lock_path).acquire(timeout_s=5.0).release()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def test_threads_per_rank_is_the_share_of_cores_unless_overridden(monkeypatch):
    monkeypatch.delenv("KVRELAY_THREADS_PER_RANK", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert default_threads_per_rank(1) == cores
    assert default_threads_per_rank(2) == max(1, cores // 2)
    assert default_threads_per_rank(cores * 4) == 1
    monkeypatch.setenv("KVRELAY_THREADS_PER_RANK", "3")
    assert default_threads_per_rank(2) == 3
