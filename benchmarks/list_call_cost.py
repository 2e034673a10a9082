"""What one ListGenerations call costs the broker's event loop, in-process (no client threads).

A GenerationServicer over the test cluster's orchestrator (tests/orchestrator/harness.py) holds
N finished generations (FAILED, prompt and negative prompt of B bytes each); each ListGenerations
is called directly, as a public caller (the redacted view) then as an operator, for page sizes
100 and 1000, and serialized as gRPC would: the mean milliseconds per call are the loop time one
call takes from everything else the broker serves (Heartbeat, ReportWrite, health).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/list_call_cost.py [--generations 1024] [--prompt-bytes 65536]

Not a test: it prints numbers; benchmarks/README.md records them.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from kvrelay.suggest import SuggestingArgumentParser


async def measure(args: argparse.Namespace) -> None:
    from kvrelay.broker.generations import ErrorInfo, GenerationParams, GenState
    from kvrelay.security import Caller, CallerClass, _current_caller
    from kvrelay.v1 import generation_pb2
    from tests.orchestrator.harness import cluster

    async with cluster(max_results=args.generations) as c:
        assert c.generation is not None
        store = c.orchestrator.store
        prompt = "x" * args.prompt_bytes
        for i in range(args.generations):
            params = GenerationParams(prompt, prompt, i, 64, 64, 1, 2.0)
            record, _ = store.create_or_attach(f"g{i}", params, True)
            error = ErrorInfo("UNAVAILABLE", "TRANSFER_TIMEOUT", f"ticket t-{i}: rows not loaded by dit-0")
            store.update(record, GenState.FAILED, error=error)
        callers = {
            "public": Caller(frozenset({CallerClass.PUBLIC}), authenticated=True),
            "operator": Caller(frozenset({CallerClass.OPERATOR}), authenticated=True),
        }
        for name, caller in callers.items():
            for size in (100, 1000):
                token = _current_caller.set(caller)
                try:
                    request = generation_pb2.ListGenerationsRequest(page_size=size)
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        reply = await c.generation.ListGenerations(request, None)  # type: ignore[arg-type]
                        reply.SerializeToString()
                    ms = (time.perf_counter() - start) / args.calls * 1000
                finally:
                    _current_caller.reset(token)
                print(f"{name:8} page_size {size:4}: {ms:7.2f} ms/call, {len(reply.generations):4} listed, "
                      f"{reply.ByteSize():8} B reply")  # fmt: skip


def main() -> None:
    parser = SuggestingArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=1024, help="finished generations held")
    parser.add_argument("--prompt-bytes", type=int, default=65536, help="each prompt and negative prompt")
    parser.add_argument("--calls", type=int, default=20, help="calls per measurement")
    args = parser.parse_args()
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
