"""A real child process for supervisor tests: takes `kvrelay broker|ar|dit` arguments, serves gRPC
health on the `--port` it is given, and behaves as the test asks (through $CHILD_BEHAVIOUR).

Each start writes a JSON record to $CHILD_STATE_DIR (argv, pid, a grandchild's pid, times), so
tests assert on what really ran. A replica checks the broker's health at `--broker` first and
refuses to start if it is not SERVING: that is how the supervisor's start order is checked.

Behaviour keys (per child name, e.g. "ar-0", or per role): serving_delay (s), crash_after (s after
SERVING, exit code crash_code, default 3), exit_at_start (exit code), ignore_sigterm (bool), grandchild (bool),
drain_seconds (after the first SIGTERM: a graceful drain this long, recorded as `draining`; a second
SIGTERM during it is a fast stop, as in kvrelay/stopping.py: exit 4 at once, recorded `fast`),
health_file (bool: once SERVING, its health follows $CHILD_STATE_DIR/<name>.health, SERVING or
NOT_SERVING, as a replica's does when its broker refuses, then takes, its credential).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def main() -> int:
    started = time.time()
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["broker", "ar", "dit"])
    parser.add_argument("--config", required=True)
    parser.add_argument("--replica", type=int, default=None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--broker", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--log-level", default=None)
    args = parser.parse_args()
    name = args.role if args.role == "broker" else f"{args.role}-{args.replica}"
    behaviours = json.loads(os.environ.get("CHILD_BEHAVIOUR", "{}"))
    behaviour = {**behaviours.get(args.role, {}), **behaviours.get(name, {})}
    state_dir = Path(os.environ["CHILD_STATE_DIR"])
    record: dict[str, object] = {"name": name, "pid": os.getpid(), "argv": sys.argv[1:], "started": started,
                                 "grpc_verbosity": os.environ.get("GRPC_VERBOSITY")}  # fmt: skip
    record_path = state_dir / f"{name}.{os.getpid()}.json"

    def save(**more: object) -> None:
        record.update(more)
        tmp = record_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(record_path)

    save()
    if "exit_at_start" in behaviour:
        print(f"kvrelay {args.role}: {name}: exiting at start as asked", flush=True)
        return int(behaviour["exit_at_start"])
    if args.role != "broker":
        if not args.broker or not _serving(args.broker):
            print(f"{name}: broker {args.broker} is not SERVING", flush=True)
            return 4
        save(broker_checked=args.broker)

    if behaviour.get("grandchild", True):
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        save(grandchild=grandchild.pid)

    stop = {"requested": False, "signals": 0}

    def on_term(signum: int, frame: object) -> None:
        stop["requested"] = True
        stop["signals"] += 1

    def on_hup(signum: int, frame: object) -> None:
        stop["requested"] = True  # a hangup (the supervisor's PDEATHSIG) never counts twice

    signal.signal(signal.SIGTERM, signal.SIG_IGN if behaviour.get("ignore_sigterm") else on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor, not a terminal, stops us
    signal.signal(signal.SIGHUP, signal.SIG_IGN if behaviour.get("ignore_sigterm") else on_hup)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if server.add_insecure_port(f"{args.host}:{args.port}") == 0:
        return 5
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    # A stop while still starting ends the start, as a real service's does (kvrelay/stopping.py
    # ends its start-up waits): a plain sleep here outlived SIGTERM, and every test stopping a child
    # in its serving_delay waited the supervisor's 10 s grace for the SIGKILL.
    serving_at = time.monotonic() + float(behaviour.get("serving_delay", 0))
    while not stop["requested"] and time.monotonic() < serving_at:
        time.sleep(0.02)
    if not stop["requested"]:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        save(serving=time.time())
        print(f"{name} listening on {args.host}:{args.port}", flush=True)
    crash_at = time.monotonic() + float(behaviour["crash_after"]) if "crash_after" in behaviour else None
    health_file = state_dir / f"{name}.health" if behaviour.get("health_file") else None
    shown = "SERVING"
    while not stop["requested"]:
        if health_file is not None:
            try:
                wanted = health_file.read_text().strip()
            except FileNotFoundError:
                wanted = "SERVING"
            if wanted != shown:
                servicer.set("", health_pb2.HealthCheckResponse.ServingStatus.Value(wanted))
                shown = wanted
                save(**{f"health_{wanted}": time.time()})
        if crash_at is not None and time.monotonic() >= crash_at:
            code = int(behaviour.get("crash_code", 3))
            print(f"kvrelay {args.role}: {name}: crashing with code {code} as asked", flush=True)
            save(exited=time.time(), exit_code=code)
            os._exit(code)  # a crash: no cleanup, the grandchild is left for the supervisor
        time.sleep(0.02)
    drain_seconds = float(behaviour.get("drain_seconds", 0))
    if drain_seconds:
        save(draining=time.time())
        drain_until = time.monotonic() + drain_seconds
        while time.monotonic() < drain_until and stop["signals"] < 2:
            time.sleep(0.02)
    fast = stop["signals"] >= 2
    server.stop(0.2)
    if behaviour.get("grandchild", True):
        grandchild.terminate()
        grandchild.wait()
    save(exited=time.time(), exit_code=4 if fast else 0, fast=fast, signals=stop["signals"])
    return 4 if fast else 0


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    sys.exit(main())
