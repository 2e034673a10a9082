"""CPU time per request of a served node, process by process (issue 15's CPU goal).

On a shared host req/s swings with the neighbours; CPU-seconds do far less. This starts the node
`kvrelay bench` starts for `--impls mooncake` (configs/single-node.yaml, the `--preset` on both
stages, `--max-num-seqs`, Mooncake TCP), warms it up, then, per run, reads the user+system CPU time
of every process of the node (broker, AR service, its rank workers, DiT service, its rank
workers) before and after `--requests` seed-workload requests at `--concurrency`, and prints CPU-ms
per request for each. The service processes (broker, AR, DiT) run no model code: their CPU is the
serving system's own cost. The rank workers run the models and also pack, write and checksum.

`--baseline DIR` starts a second node from another checkout (its code through PYTHONPATH: e.g.
`git worktree add /tmp/kv-base main`) and interleaves the two run by run, so both see the same
neighbours:

    .venv/bin/python benchmarks/served_cpu.py --requests 32 --runs 3 [--baseline /tmp/kv-base]

`--profile DIR` runs the service processes under cProfile for the measured runs only (started and
dumped by SIGUSR1/SIGUSR2 around them): DIR/<process>-<pid>.prof, read with `python -m pstats`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
GROUPS = ("broker", "ar", "ar-ranks", "dit", "dit-ranks")
SERVICE_GROUPS = ("broker", "ar", "dit")
PER_REPLICA = {"Heartbeat", "RegisterReplica", "DeregisterReplica"}


def _cpu(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0
    return float(t.user + t.system)


class ServedNode:
    """One node (broker + AR + DiT processes) started from `checkout`'s code."""

    def __init__(self, label: str, checkout: Path, data: dict[str, Any], workdir: Path, profile: Path | None) -> None:
        import yaml

        from kvrelay.config import parse_config
        from kvrelay.node.supervisor import start_node
        from kvrelay.server import reserve_free_port

        self.label = label
        data = {**data, "broker": dict(data["broker"]), "stages": [dict(s) for s in data["stages"]]}
        data["broker"]["port"] = reserve_free_port()
        data["broker"]["metrics_port"] = reserve_free_port()
        data["broker"]["journal_path"] = str(workdir / f"{label}-broker.sqlite")
        for stage in data["stages"]:
            stage["port"] = reserve_free_port()
            stage["metrics_port"] = reserve_free_port()
        cfg = parse_config(data, f"served-cpu-{label}")
        path = workdir / f"{label}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        rundir = workdir / label
        rundir.mkdir(parents=True, exist_ok=True)
        env = {"PYTHONPATH": str(checkout)}
        command = None
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
            env["SERVED_CPU_PROFILE_DIR"] = str(profile / label)
            command = (sys.executable, str(Path(__file__).resolve()), "--as-child")
        self.target = f"{cfg.broker.host}:{cfg.broker.port}"
        self.metrics_url = f"http://{cfg.broker.host}:{cfg.broker.metrics_port}/metrics"
        self.node = start_node(path, log_dir=workdir / f"{label}-logs", cwd=rundir, env=env, command=command)
        self.profiling = profile is not None

    def processes(self) -> dict[str, list[psutil.Process]]:
        groups: dict[str, list[psutil.Process]] = {g: [] for g in GROUPS}
        for info in self.node.processes():
            if info.pid is None:
                continue
            proc = psutil.Process(info.pid)
            groups[info.role].append(proc)
            if info.role != "broker":
                groups[f"{info.role}-ranks"].extend(proc.children(recursive=True))
        return groups

    def cpu(self) -> dict[str, float]:
        return {g: sum(_cpu(p) for p in procs) for g, procs in self.processes().items()}

    def broker_rpcs(self) -> dict[str, float]:
        """`kvrelay_broker_rpcs_total` by method so far (a WatchTicket stream counts once)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        pattern = r'^kvrelay_broker_rpcs_total\{method="(\w+)"\} ([0-9.e+]+)$'
        return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}

    def threads(self) -> dict[str, float]:
        """CPU seconds so far per (group, thread name), threads of one name summed."""
        out: dict[str, float] = {}
        for group, procs in self.processes().items():
            for proc in procs:
                try:
                    tids = [t.id for t in proc.threads()]
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                for tid in tids:
                    try:
                        stat = Path(f"/proc/{proc.pid}/task/{tid}/stat").read_text()
                        name = Path(f"/proc/{proc.pid}/task/{tid}/comm").read_text().strip()
                    except OSError:
                        continue
                    fields = stat.rsplit(")", 1)[1].split()
                    ticks = int(fields[11]) + int(fields[12])  # utime, stime
                    key = f"{group}/{'main' if tid == proc.pid else name}"
                    out[key] = out.get(key, 0.0) + ticks / os.sysconf("SC_CLK_TCK")
        return out

    def signal_services(self, sig: int) -> None:
        for g in SERVICE_GROUPS:
            for proc in self.processes()[g]:
                proc.send_signal(sig)

    def drive(self, workload: Any, requests: int, concurrency: int, offset: int) -> tuple[int, float]:
        from kvrelay.node.bench import drive

        start = time.perf_counter()
        records = asyncio.run(
            drive(self.target, workload, requests, concurrency, offset,
                  client_options=self.node.credentials.client_options())  # fmt: skip
        )
        failed = [r.error for r in records if not r.ok]
        if failed:
            raise RuntimeError(f"{self.label}: {len(failed)} requests failed: {failed[:3]}")
        return len(records), time.perf_counter() - start

    def stop(self) -> None:
        self.node.stop()


def _table(label_runs: dict[str, list[dict[str, float]]]) -> str:
    head = "| node | " + " | ".join(GROUPS) + " | services | all | wall s/req | broker RPCs/req |"
    lines = [head, "| --- |" + " ---: |" * (len(GROUPS) + 4)]
    for label, runs in label_runs.items():
        mean = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
        services = sum(mean[g] for g in SERVICE_GROUPS)
        total = sum(mean[g] for g in GROUPS)
        cells = " | ".join(f"{mean[g]:.1f}" for g in GROUPS)
        lines.append(f"| {label} | {cells} | **{services:.1f}** | {total:.1f} | {mean['wall']:.3f} | "
                     f"{mean['rpcs']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--as-child":
        return _as_child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs/single-node.yaml"))
    parser.add_argument("--preset", default="small")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--guidance-scale", type=float, default=2.0)
    parser.add_argument("--dataset", default="benchmarks/data/t2i-50.jsonl")
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with, interleaved")
    parser.add_argument("--profile", type=Path, help="cProfile the service processes into this folder")
    parser.add_argument("--threads", action="store_true", help="also print CPU-ms per request per thread name")
    args = parser.parse_args()

    from kvrelay.config import load_config
    from kvrelay.node.bench import load_dataset, scenario_config, seed_workload
    from kvrelay.resources import resolve

    base = load_config(args.config).model_dump(mode="json", exclude_none=True)
    data = scenario_config(base, args.preset, args.max_num_seqs)
    workload = seed_workload(args, args.preset, load_dataset(resolve(args.dataset, "data")))
    checkouts = {"this": REPO}
    if args.baseline is not None:
        checkouts = {"baseline": args.baseline.resolve(), "this": REPO}
    nodes: dict[str, ServedNode] = {}
    per_run: dict[str, list[dict[str, float]]] = {label: [] for label in checkouts}
    with tempfile.TemporaryDirectory(prefix="kvrelay-served-cpu-") as tmp:
        try:
            for label, checkout in checkouts.items():
                print(f"served_cpu: starting {label} ({checkout})", file=sys.stderr, flush=True)
                nodes[label] = ServedNode(label, checkout, data, Path(tmp), args.profile)
                if args.warmup:
                    nodes[label].drive(workload, args.warmup, min(args.warmup, args.concurrency), 0)
            for run in range(args.runs):
                for label, node in nodes.items():
                    if node.profiling:
                        node.signal_services(signal.SIGUSR1)
                    rpcs_before = node.broker_rpcs()
                    before, threads_before = node.cpu(), node.threads() if args.threads else {}
                    n, wall = node.drive(workload, args.requests, args.concurrency, run * args.requests)
                    after, threads_after = node.cpu(), node.threads() if args.threads else {}
                    rpcs = {m: (c - rpcs_before.get(m, 0.0)) / n for m, c in node.broker_rpcs().items()}
                    if node.profiling:
                        node.signal_services(signal.SIGUSR2)
                    row = {g: (after[g] - before[g]) * 1e3 / n for g in GROUPS}
                    row["wall"] = wall / n
                    row["rpcs"] = sum(c for m, c in rpcs.items() if m not in PER_REPLICA)
                    listed = ", ".join(f"{m} {c:.2f}" for m, c in sorted(rpcs.items()) if c)
                    print(f"served_cpu: {label} run {run + 1}: broker RPCs per request: {listed}", file=sys.stderr,
                          flush=True)  # fmt: skip
                    per_run[label].append(row)
                    for key in sorted(threads_after, key=lambda k: threads_before.get(k, 0.0) - threads_after[k]):
                        spent = (threads_after[key] - threads_before.get(key, 0.0)) * 1e3 / n
                        if spent >= 0.5:
                            print(f"served_cpu: {label} run {run + 1}:   {key:<32} {spent:8.1f} CPU-ms/request",
                                  file=sys.stderr, flush=True)  # fmt: skip
                    cells = " ".join(f"{g}={row[g]:.1f}" for g in GROUPS)
                    print(f"served_cpu: {label} run {run + 1}: CPU-ms/request {cells}; "
                          f"{n / wall:.3f} req/s", file=sys.stderr, flush=True)  # fmt: skip
        finally:
            for node in nodes.values():
                node.stop()
    print(f"\nCPU-ms per request ({args.preset}, max_num_seqs {args.max_num_seqs}, {args.runs} runs x "
          f"{args.requests} requests, concurrency {args.concurrency}; means over runs)\n")  # fmt: skip
    print(_table(per_run))
    return 0


def _as_child(argv: list[str]) -> int:
    """Run `kvrelay ARGV` with cProfile switched on by SIGUSR1 and dumped by SIGUSR2."""
    import cProfile

    out = Path(os.environ["SERVED_CPU_PROFILE_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()

    def start(*_: Any) -> None:
        prof.enable()

    def dump(*_: Any) -> None:
        prof.disable()
        prof.dump_stats(out / f"{argv[0]}-{os.getpid()}.prof")

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, dump)
    from kvrelay.node.cli import main as kvrelay_main

    return int(kvrelay_main(argv) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
