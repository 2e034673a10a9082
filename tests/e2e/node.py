"""Real nodes for end-to-end tests: a config derived from tests/configs/test-fast.yaml (or another
file of tests/configs), started by the supervisor in its own folder (locks, journal), always stopped."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import yaml

from tests.threads import torch_threads

REPO = Path(__file__).resolve().parents[2]


def write_config(
    tmp: Path, name: str, edit: Callable[[dict[str, Any]], None] | None = None, base: str = "test-fast.yaml"
) -> Path:
    cfg = yaml.safe_load((REPO / "tests/configs" / base).read_text())
    cfg["broker"]["journal_path"] = str(tmp / f"{name}.sqlite")
    if edit is not None:
        edit(cfg)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def fallback(cfg: dict[str, Any]) -> None:
    """The gRPC-stream fallback: kv_transfer_config absent on both stages."""
    for stage in cfg["stages"]:
        stage.pop("kv_transfer_config", None)


@contextmanager
def running_node(
    tmp: Path, name: str, edit: Callable[[dict[str, Any]], None] | None = None, base: str = "test-fast.yaml"
) -> Iterator[Any]:
    from kvrelay.node.supervisor import start_node

    path = write_config(tmp, name, edit, base)
    rundir = tmp / name
    rundir.mkdir(exist_ok=True)
    with start_node(path, log_dir=rundir / "logs", cwd=rundir) as node:
        yield node


def wait_pools_full(client: Any, timeout: float = 20.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        pools = client.get_pools()
        if pools and all(p.free_pages == p.total_pages for p in pools):
            return pools
        assert time.monotonic() < deadline, f"pages did not come back: {pools}"
        time.sleep(0.05)


def wait_broker(client: Any, timeout: float = 60.0) -> None:
    """Until a (restarted) broker answers."""
    from kvrelay.client import KvRelayError

    deadline = time.monotonic() + timeout
    while True:
        try:
            client.get_pools()
            return
        except KvRelayError:
            assert time.monotonic() < deadline, "the broker did not come back"
            time.sleep(0.1)


def threads_of_the_ranks(config_path: Path) -> AbstractContextManager[int]:
    """torch_threads at the count the node's CPU ranks use (the node's cpu_share_env, else the
    environment's KVRELAY_THREADS_PER_RANK), for a local reference of the node's bits."""
    import torch

    from kvrelay.config import load_config
    from kvrelay.node.supervisor import cpu_share_env

    share = cpu_share_env(load_config(config_path)).get("KVRELAY_THREADS_PER_RANK")
    return torch_threads(int(share or os.environ.get("KVRELAY_THREADS_PER_RANK") or torch.get_num_threads()))
