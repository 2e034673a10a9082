"""Broker round trips per request, counted on a real node (issue 13: "the broker plans once").

Starts broker + AR + DiT as real processes (tiny models, Mooncake TCP, the test config's timings),
runs one warm-up request, then `--requests` sequential requests, and reads the broker's
`kvrelay_broker_rpcs_total{method}` counter before and after: every BrokerService call a replica
made for those requests, divided by their number. Heartbeats are listed apart (they are per
replica and per second, not per request).

    .venv/bin/python benchmarks/round_trips.py --requests 5 [--tp-ar 1 --tp-dit 1] [--guidance 2.0]
"""

from __future__ import annotations

import argparse
import re
import tempfile
import urllib.request
from pathlib import Path

import yaml

from kvrelay.server import reserve_free_port

REPO = Path(__file__).resolve().parents[1]
PER_REPLICA = {"Heartbeat", "RegisterReplica", "DeregisterReplica"}


def _free_port() -> int:
    return reserve_free_port()


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^kvrelay_broker_rpcs_total\{method="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--tp-ar", type=int, default=1)
    parser.add_argument("--tp-dit", type=int, default=1)
    parser.add_argument("--guidance", type=float, default=2.0)
    args = parser.parse_args()

    from kvrelay.client import KvRelayClient
    from kvrelay.node.supervisor import start_node

    cfg = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    metrics_port = _free_port()
    cfg["broker"]["metrics_port"] = metrics_port
    cfg["stages"][0]["tensor_parallel_size"] = args.tp_ar
    cfg["stages"][1]["tensor_parallel_size"] = args.tp_dit
    with tempfile.TemporaryDirectory(prefix="kvrelay-rt-") as tmp:
        cfg["broker"]["journal_path"] = f"{tmp}/broker.sqlite"
        path = Path(tmp) / "node.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        with start_node(path, log_dir=Path(tmp) / "logs", cwd=tmp) as node, KvRelayClient(
            node.address(), timeout=60
        ) as client:
            client.generate("warm up", seed=0, width=64, height=64, guidance_scale=args.guidance).result()
            before = _scrape(metrics_port)
            for i in range(args.requests):
                client.generate(f"a red fox {i}", seed=i, width=64, height=64, guidance_scale=args.guidance).result()
            after = _scrape(metrics_port)
    per_request = {m: (after.get(m, 0) - before.get(m, 0)) / args.requests for m in sorted(after)}
    rows = 2 if args.guidance > 1 else 1
    print(f"requests={args.requests} rows={rows} tp_ar={args.tp_ar} tp_dit={args.tp_dit} transport=mooncake")
    total = 0.0
    for method, n in per_request.items():
        if method in PER_REPLICA or n == 0:
            continue
        total += n
        print(f"  {method:<16} {n:6.2f} per request")
    print(f"  {'TOTAL':<16} {total:6.2f} broker round trips per request (heartbeats excluded)")


if __name__ == "__main__":
    main()
