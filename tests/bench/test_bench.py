"""`kvrelay bench` end to end on a tiny workload: every implementation, interleaved, all complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_runs_every_implementation_and_reports(repo_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvrelay", "bench",
            "--config", str(repo_root / "tests/configs/test-fast.yaml"),
            "--preset", "tiny", "--requests", "3", "--runs", "2", "--concurrency", "2", "--warmup", "1",
            "--width", "64", "--height", "64", "--output", str(out),
        ],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
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
def test_bench_dit_parallel_compares_ep_and_cfg_on_off_in_one_run(repo_root: Path, tmp_path: Path) -> None:
    """`--dit-parallel` with the MoE preset: one node per DiT layout (same concurrency/batching),
    every request completes on each, and the EP / CFG-parallel ratios are printed side by side."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvrelay", "bench", "--dit-parallel",
            "--config", str(repo_root / "tests/configs/test-fast.yaml"),
            "--preset", "tiny-moe", "--requests", "2", "--runs", "1", "--concurrency", "2", "--warmup", "1",
            "--max-num-seqs", "2", "--width", "64", "--height", "64", "--output", str(out),
        ],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all requests completed: True" in proc.stdout
    for line in ("| EP on / EP off (TP=2) |", "| CFG-parallel on / off (TP=1; 2 ranks vs 1) |",
                 "| DiT CFG=2 x TP=1 (2 ranks) |", "| DiT TP=2 (2 ranks), EP on |"):
        assert line in proc.stdout, proc.stdout[-3000:]
    report = json.loads((out / "bench.json").read_text())
    results = report["scenarios"]["seed"]["results"]
    assert [r["impl"] for r in results] == ["dit-tp1", "dit-cfg2", "dit-tp2", "dit-tp2-ep"]
    assert all(r["completed"] == 2 and r["bytes_moved"] > 0 for r in results)
