"""`kvrelay bench` reporting in-process: progress and the live table while it runs, and a
throughput plot whose x axis counts runs in whole numbers."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from kvrelay.node.bench import BenchProgress, RequestRecord, detail_table, parallel_table, plot, summarize


def _results() -> list[Any]:
    out = []
    for run in range(3):
        for impl, latency in (("mooncake", 0.5), ("grpc", 0.7)):
            records = [RequestRecord(True, latency + 0.01 * i, 0.001, {"denoise_seconds": 0.3}) for i in range(4)]
            out.append(summarize(impl, run, records, wall_s=2.0 + run, bytes_moved=1024))
    return out


def test_progress_reports_requests_and_a_table_after_every_run() -> None:
    stream = io.StringIO()
    progress = BenchProgress("seed", ["mooncake", "grpc"], runs=2, requests=4, stream=stream)
    for result in _results()[:2]:
        progress.start_run(result.impl, result.run)
        for _ in range(4):
            progress.request_done(RequestRecord(True, 0.5))
        progress.end_run(result)
    text = stream.getvalue()
    assert "bench[seed] mooncake run 1/2: 4/4 done, 0 failed" in text
    assert "bench[seed] grpc run 1/2: 2.0000 req/s" in text
    # The live table after the second run holds both implementations.
    assert text.count("| Implementation |") == 2
    assert "| gRPC stream fallback (legacy path) | 2.0000 |" in text


def test_the_throughput_plot_counts_runs_in_whole_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    paths = plot(_results(), ["mooncake", "grpc"], tmp_path, "seed")
    assert [p.name for p in paths] == ["seed-throughput.png", "seed-latency-cdf.png", "seed-phases.png"]
    ticks = list(figures[0].axes[0].get_xticks())
    assert ticks == [1, 2, 3]
    for fig in figures:
        fig.clf()


def test_dit_parallel_table_puts_ep_and_cfg_on_off_side_by_side_with_ratios() -> None:
    """`--dit-parallel`: one row per DiT layout, then EP on/off and CFG-parallel on/off as ratios
    of the means (req/s; denoise time off / on), from runs of the same workload."""
    denoise = {"dit-tp1": 0.4, "dit-cfg2": 0.2, "dit-tp2": 0.25, "dit-tp2-ep": 0.5}
    wall = {"dit-tp1": 4.0, "dit-cfg2": 2.0, "dit-tp2": 2.5, "dit-tp2-ep": 5.0}
    results = []
    for run in range(2):
        for impl in denoise:
            records = [RequestRecord(True, 1.0, 0.0, {"denoise_seconds": denoise[impl]}) for _ in range(4)]
            results.append(summarize(impl, run, records, wall_s=wall[impl], bytes_moved=4 * 2**20))
    table = parallel_table(results)
    assert "| DiT CFG=2 x TP=1 (2 ranks) | 2.0000 | 1.000 | 200.0 | 1.000 |" in table
    assert "| EP on / EP off (TP=2) | 0.500x | 0.500x |" in table
    assert "| CFG-parallel on / off (TP=1; 2 ranks vs 1) | 2.000x | 2.000x |" in table
    assert "| CFG=2 x TP=1 / TP=2 (2 ranks each) | 1.250x | 1.250x |" in table
    # Without a pair of layouts there is nothing to compare.
    assert parallel_table([r for r in results if r.impl == "dit-tp1"]) == ""


def test_detail_table_prints_na_for_the_colocated_prefill_rate() -> None:
    """The colocated baseline has no served AR whose metrics give a prefill rate: its cell is
    "n/a", not a measured-looking 0; a served run's measured rate is printed as a number."""
    records = [RequestRecord(True, 0.5, 0.001, {"denoise_seconds": 0.3}) for _ in range(2)]
    served = summarize("mooncake", 0, records, wall_s=1.0, bytes_moved=1024)
    served.prefill_tokens_per_s = 1234.4
    colocated = summarize("colocated", 0, records, wall_s=1.0, bytes_moved=0)
    rows = {line.split(" | ")[0]: line.split(" | ") for line in detail_table([served, colocated]).splitlines()}
    assert rows["| mooncake"][4] == "1234"
    assert rows["| colocated"][4] == "n/a"
