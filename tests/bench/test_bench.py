"""`kvrelay bench` end to end on a tiny workload: every implementation, interleaved, all complete."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_CONFIG = str(REPO / "tests/configs/test-fast.yaml")
_RUNS = {
    "test_bench_runs_every_implementation_and_reports": [
        "--config", _CONFIG, "--preset", "tiny", "--requests", "3", "--runs", "2", "--concurrency", "2",
        "--warmup", "1", "--width", "64", "--height", "64",
    ],
    "test_bench_dit_parallel_compares_ep_and_cfg_on_off_in_one_run": [
        "--dit-parallel", "--config", _CONFIG, "--preset", "tiny-moe", "--requests", "2", "--runs", "1",
        "--concurrency", "2", "--warmup", "1", "--max-num-seqs", "2", "--width", "64", "--height", "64",
    ],
}  # fmt: skip
# Printed once every node of the bench has started (all its ports bound), before the first request.
_NODES_UP = "bench[seed]: warming up "
_TIMEOUT_S = 600.0


class _BenchRuns:
    """The `kvrelay bench` runs of the tests selected here, one after another but overlapping: the
    next starts once the one before has all its nodes up (`_NODES_UP`, or it ended), so that its
    node start-up (CPU: interpreters importing torch) runs while the one before serves its few
    requests and stops its nodes (mostly the services' stop graces). Never two benches picking
    ports at once: a port one picked and had not bound yet could be picked by the other."""

    def __init__(self, names: list[str], workdir: Path) -> None:
        self.names, self.workdir = names, workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started: dict[str, threading.Event] = {name: threading.Event() for name in names}
        self.started_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drive, name="bench-runs", daemon=True)
        self._thread.start()

    def _paths(self, name: str) -> tuple[Path, Path, Path]:
        folder = self.workdir / name
        return folder, folder / "stdout", folder / "stderr"

    def _drive(self) -> None:
        try:
            for name in self.names:
                folder, stdout, stderr = self._paths(name)
                folder.mkdir()
                with stdout.open("wb") as out, stderr.open("wb") as err:
                    # cwd is the run's own folder: the default dataset is found from another directory.
                    self.procs[name] = subprocess.Popen(
                        [sys.executable, "-m", "kvrelay", "bench", *_RUNS[name], "--output", str(folder / "results")],
                        stdout=out, stderr=err, cwd=folder,
                    )  # fmt: skip
                self.started_at[name] = time.monotonic()
                self.started[name].set()
                deadline = time.monotonic() + _TIMEOUT_S
                while (self.procs[name].poll() is None and time.monotonic() < deadline and not self._stop.is_set()
                       and _NODES_UP not in stderr.read_text(errors="replace")):  # fmt: skip
                    time.sleep(0.2)
                if self._stop.is_set():
                    return
        finally:
            for event in self.started.values():
                event.set()

    def result(self, name: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        """The run of test `name` once it ended (its own 600 s from its start), and its --output."""
        assert self.started[name].wait(2 * _TIMEOUT_S), f"{name}: its bench never started"
        assert name in self.procs, f"{name}: its bench never started"
        proc = self.procs[name]
        proc.wait(max(1.0, self.started_at[name] + _TIMEOUT_S - time.monotonic()))
        folder, stdout, stderr = self._paths(name)
        return (
            subprocess.CompletedProcess(proc.args, proc.returncode, stdout.read_text(errors="replace"),
                                        stderr.read_text(errors="replace")),
            folder / "results",
        )  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="module")
def bench_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_BenchRuns]:
    selected = {getattr(item, "originalname", None) for item in request.session.items}
    runs = _BenchRuns([name for name in _RUNS if name in selected], tmp_path_factory.mktemp("bench"))
    try:
        yield runs
    finally:
        runs.close()


@pytest.mark.slow
def test_bench_runs_every_implementation_and_reports(bench_runs: _BenchRuns) -> None:
    proc, out = bench_runs.result("test_bench_runs_every_implementation_and_reports")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| Native MooncakeConnector |" in proc.stdout
    assert "| gRPC stream fallback (legacy path) |" in proc.stdout
    assert "all requests completed: True" in proc.stdout
    # The default dataset is found from another directory (cwd is tmp_path), and progress and the
    # table so far are on stderr while it runs.
    assert "bench[seed] mooncake run 1/2: 3/3 done, 0 failed" in proc.stderr
    assert "bench[seed] colocated run 2/2: " in proc.stderr
    assert proc.stderr.count("| Implementation |") == 6
    report = json.loads((out / "bench.json").read_text())
    results = report["scenarios"]["seed"]["results"]
    # Interleaved: run 1 of every implementation comes before run 2 of any.
    assert [(r["impl"], r["run"]) for r in results] == [
        ("mooncake", 0), ("grpc", 0), ("colocated", 0), ("mooncake", 1), ("grpc", 1), ("colocated", 1)
    ]
    for r in results:
        assert r["completed"] == 3 and r["failed"] == 0 and r["req_per_s"] > 0
        if r["impl"] != "colocated":
            assert r["bytes_moved"] > 0, r
    assert {Path(p).name for p in report["scenarios"]["seed"]["plots"]} == {
        "seed-throughput.png", "seed-latency-cdf.png", "seed-phases.png"
    }


@pytest.mark.slow
def test_bench_dit_parallel_compares_ep_and_cfg_on_off_in_one_run(bench_runs: _BenchRuns) -> None:
    """`--dit-parallel` with the MoE preset: one node per DiT layout (same concurrency/batching),
    every request completes on each, and the EP / CFG-parallel ratios are printed side by side."""
    proc, out = bench_runs.result("test_bench_dit_parallel_compares_ep_and_cfg_on_off_in_one_run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all requests completed: True" in proc.stdout
    for line in ("| EP on / EP off (TP=2) |", "| CFG-parallel on / off (TP=1; 2 ranks vs 1) |",
                 "| DiT CFG=2 x TP=1 (2 ranks) |", "| DiT TP=2 (2 ranks), EP on |"):
        assert line in proc.stdout, proc.stdout[-3000:]
    report = json.loads((out / "bench.json").read_text())
    results = report["scenarios"]["seed"]["results"]
    assert [r["impl"] for r in results] == ["dit-tp1", "dit-cfg2", "dit-tp2", "dit-tp2-ep"]
    assert all(r["completed"] == 2 and r["bytes_moved"] > 0 for r in results)
