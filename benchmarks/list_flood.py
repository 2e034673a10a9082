"""The broker's health and internal RPCs while clients flood ListGenerations.

A real broker process (`kvrelay broker`, development credentials) starts over a journal holding N
finished generations (failed, cancelled and succeeded ones, each with a prompt and negative prompt
of B bytes), restored by its GenerationStore as after a restart. A probe registers an AR replica
and, every few ms, times a Heartbeat then a grpc.health Check on a channel of its own. Two windows,
each of `--seconds`:

- `idle`: the probe alone;
- `flood`: `--threads` client threads (one process, a channel each) call ListGenerations
  back to back (page_size `--page-size`, following next_page_token where the broker gives one);
  a refused call is made again after 1 ms, or with `--obey-retry` after the wait the refusal
  names (google.rpc.RetryInfo), as a client that follows the broker's word does.

Prints, per window, the Heartbeat and Health latency p50/p99/max, and the flood's list calls,
generations listed and refusals per second. Not a test: it prints numbers; benchmarks/README.md
and the commit that changed the list path record them.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/list_flood.py [--generations 1024] [--prompt-bytes 65536] \
        [--threads 4] [--seconds 20] [--page-size 0] [--obey-retry]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from kvrelay.suggest import SuggestingArgumentParser

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from broker_journal import _pct, _replica  # noqa: E402

TTL_SECONDS = 3600.0
# With --tokens the broker takes these (env), as a deployment with credentials does: the flood
# calls with the api token (the redacted view), the probe as its replica with the replica token.
TOKENS = {"KVRELAY_API_TOKEN": "bench-api-token", "KVRELAY_REPLICA_TOKEN": "bench-replica-token",
          "KVRELAY_OPERATOR_TOKEN": "bench-operator-token"}  # fmt: skip


def seed_journal(path: str, generations: int, prompt_bytes: int) -> None:
    """`generations` finished ones, as a busy broker retains them: a third failed (messages naming
    a ticket, replicas and an address), a third cancelled, a third succeeded (a small PNG)."""
    from kvrelay.broker.generations import ErrorInfo, GenerationParams, GenerationStore, GenState, ImageResult
    from kvrelay.broker.journal import Journal

    journal = Journal(path, "OFF")
    store = GenerationStore(result_ttl_seconds=TTL_SECONDS, max_results=generations, journal=journal)
    prompt = ("a watercolour of a lighthouse " * (prompt_bytes // 30 + 1))[:prompt_bytes]
    for n in range(generations):
        record, _ = store.create_or_attach(
            f"flood-{n}", GenerationParams(prompt, prompt, n, 64, 64, 1, 2.0), True
        )
        store.update(record, GenState.DENOISING, ticket_id=f"t-{n:08x}")
        if n % 3 == 0:
            error = ErrorInfo("UNAVAILABLE", "TRANSFER_TIMEOUT", f"ticket t-{n:08x}: the KV of ar-0 did not reach "
                              "dit-0 (127.0.0.1:50123) within 5 s")  # fmt: skip
            store.update(record, GenState.FAILED, error=error)
        elif n % 3 == 1:
            store.update(record, GenState.CANCELLED, error=ErrorInfo("CANCELLED", "CANCELLED", "cancelled"))
        else:
            store.update(record, GenState.SUCCEEDED, image=ImageResult(b"\x89PNG" + bytes(2000), 64, 64, n))
        store.persist(record)
    journal.close()


def write_config(workdir: Path, generations: int) -> Path:
    import yaml

    cfg = yaml.safe_load((ROOT / "tests/configs/test-fast.yaml").read_text())
    cfg["broker"].update(journal_path=str(workdir / "broker.sqlite"), result_ttl_seconds=TTL_SECONDS,
                         max_results=generations, max_queue=16)  # fmt: skip
    path = workdir / "broker.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_broker(config: Path, workdir: Path, tokens: bool) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "kvrelay", "broker", "--config", str(config), "--port", "0", "--metrics-port", "0",
           "--log-level", "warning"]  # fmt: skip
    log = workdir / "broker.log"
    with log.open("wb") as out:  # a file, not a pipe: nobody reads the broker's logs meanwhile
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(TOKENS if tokens else {})}
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        # Its stdout is captured into its JSON log lines (kvrelay.logging.capture_native_output).
        if found := re.search(r"kvrelay broker listening on ([0-9.:]+)", log.read_text(errors="replace")):
            return child, found.group(1)
        time.sleep(0.1)
    child.kill()
    raise RuntimeError(f"the broker did not listen: {log.read_text(errors='replace')[-2000:]}")


# ------------------------------------------------------------------ the flood (a child process)


def _metadata(token: str | None, replica_id: str | None = None) -> list[tuple[str, str]]:
    out = [] if token is None else [("authorization", f"Bearer {token}")]
    return out + ([("kvrelay-replica-id", replica_id)] if replica_id and token else [])


def _retry_delay(err: grpc.RpcError) -> float | None:
    """The wait a refusal names (google.rpc.RetryInfo), or None."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return float(info.retry_delay.ToNanoseconds()) / 1e9
    return None


def flood(target: str, threads: int, seconds: float, page_size: int, token: str | None, obey: bool) -> None:
    """Prints one JSON line: list calls, generations listed and refusals, by the window's end."""
    from kvrelay.security import channel_options
    from kvrelay.v1 import generation_pb2, generation_pb2_grpc

    counts: dict[str, Any] = {"calls": 0, "listed": 0, "refused": 0, "failed": 0, "first_failure": ""}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    token_field = "page_token" in generation_pb2.ListGenerationsRequest.DESCRIPTOR.fields_by_name

    def worker() -> None:
        channel = grpc.insecure_channel(target, options=channel_options())
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        page_token = ""
        while time.monotonic() < deadline:
            request = generation_pb2.ListGenerationsRequest(page_size=page_size)
            if token_field:
                request.page_token = page_token
            try:
                reply = stub.ListGenerations(request, timeout=60, metadata=_metadata(token))
            except grpc.RpcError as err:
                with lock:
                    counts["refused" if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "failed"] += 1
                    counts["first_failure"] = counts["first_failure"] or f"{err.code().name}: {err.details()}"
                delay = _retry_delay(err) if obey else None
                time.sleep(0.001 if delay is None else min(delay, max(0.0, deadline - time.monotonic())))
                continue
            page_token = getattr(reply, "next_page_token", "")
            with lock:
                counts["calls"] += 1
                counts["listed"] += len(reply.generations)
        channel.close()

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps(counts), flush=True)


# ------------------------------------------------------------------ the probe


def probe_window(target: str, seconds: float, interval: float, token: str | None) -> dict[str, list[float]]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvrelay.security import channel_options
    from kvrelay.v1 import broker_pb2, broker_pb2_grpc

    channel = grpc.insecure_channel(target, options=channel_options())
    broker, health = broker_pb2_grpc.BrokerServiceStub(channel), health_pb2_grpc.HealthStub(channel)
    out: dict[str, list[float]] = {"heartbeat_ms": [], "health_ms": []}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        broker.Heartbeat(broker_pb2.HeartbeatRequest(replica_id="ar-probe", incarnation_id="ar-probe-inc"), timeout=60,
                         metadata=_metadata(token, "ar-probe"))  # fmt: skip
        t1 = time.perf_counter()
        health.Check(health_pb2.HealthCheckRequest(), timeout=60)
        t2 = time.perf_counter()
        out["heartbeat_ms"].append((t1 - t0) * 1000)
        out["health_ms"].append((t2 - t1) * 1000)
        time.sleep(interval)
    channel.close()
    return out


def summary(name: str, probes: dict[str, list[float]]) -> str:
    parts = [name]
    for key, values in probes.items():
        parts.append(f"{key.removesuffix('_ms')} p50 {_pct(values, 0.5):.1f} p99 {_pct(values, 0.99):.1f} "
                     f"max {max(values):.1f} ms (n={len(values)})")  # fmt: skip
    return " | ".join(parts)


def main() -> None:
    parser = SuggestingArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=1024, help="finished generations in the journal")
    parser.add_argument("--prompt-bytes", type=int, default=65536, help="each prompt and negative prompt")
    parser.add_argument("--threads", type=int, default=4, help="flooding client threads")
    parser.add_argument("--seconds", type=float, default=20.0, help="each window")
    parser.add_argument("--page-size", type=int, default=0, help="ListGenerations page_size (0: the default)")
    parser.add_argument("--probe-interval", type=float, default=0.02, help="seconds between probes")
    parser.add_argument(
        "--tokens",
        action="store_true",
        help="api/replica/operator tokens set: the flood lists as a public caller (redacted)",
    )
    parser.add_argument(
        "--obey-retry",
        action="store_true",
        help="the flood waits as long as a refusal says (RetryInfo) before its next call",
    )
    parser.add_argument("--flood", nargs=6, metavar=("TARGET", "THREADS", "SECONDS", "PAGE_SIZE", "TOKEN", "OBEY"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.flood:
        target, threads, seconds, page_size, token, obey = args.flood
        flood(target, int(threads), float(seconds), int(page_size), token or None, obey == "1")
        return
    from kvrelay.security import channel_options
    from kvrelay.v1 import broker_pb2, broker_pb2_grpc

    replica_token = TOKENS["KVRELAY_REPLICA_TOKEN"] if args.tokens else None
    api_token = TOKENS["KVRELAY_API_TOKEN"] if args.tokens else ""
    with tempfile.TemporaryDirectory(prefix="list-flood-") as tmp:
        workdir = Path(tmp)
        config = write_config(workdir, args.generations)
        seed_journal(str(workdir / "broker.sqlite"), args.generations, args.prompt_bytes)
        broker, target = start_broker(config, workdir, args.tokens)
        try:
            with grpc.insecure_channel(target, options=channel_options()) as channel:
                broker_pb2_grpc.BrokerServiceStub(channel).RegisterReplica(
                    broker_pb2.RegisterReplicaRequest(
                        replica=_replica("ar-probe", False), token=replica_token or ""
                    ),
                    timeout=30,
                    metadata=_metadata(replica_token, "ar-probe"),
                )
            idle = probe_window(target, args.seconds, args.probe_interval, replica_token)
            flooder = subprocess.Popen(
                [sys.executable, __file__, "--flood", target, str(args.threads), str(args.seconds), str(args.page_size),
                 api_token, "1" if args.obey_retry else "0"],
                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            time.sleep(0.5)  # the flood's threads connected
            flooded = probe_window(target, args.seconds - 1.0, args.probe_interval, replica_token)
            out, _ = flooder.communicate(timeout=args.seconds + 120)
            counts: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        finally:
            broker.terminate()
            broker.wait(30)
    print(f"broker with {args.generations} finished generations, prompts {args.prompt_bytes} B; "
          f"{args.threads} threads x {args.seconds:g} s of ListGenerations page_size {args.page_size}, "
          + ("as a public caller (api token)" if args.tokens else "development (every caller an operator)")
          + (", obeying RetryInfo" if args.obey_retry else ""))  # fmt: skip
    print(summary("idle ", idle))
    print(summary("flood", flooded))
    per_s = {k: v / args.seconds for k, v in counts.items() if k != "first_failure"}
    print(
        f"flood: {per_s['calls']:.0f} list calls/s, {per_s['listed']:.0f} generations listed/s, "
        f"{per_s['refused']:.0f} refused/s (RESOURCE_EXHAUSTED), {per_s['failed']:.0f} other failures/s"
        + (f" (first: {counts['first_failure']})" if counts["first_failure"] else "")
    )


if __name__ == "__main__":
    main()
