"""CFG-parallel end to end (issue 21): a node whose DiT runs cfg_parallel_size: 2
(tests/configs/test-cfg-parallel.yaml: AR TP=2 -> DiT CFG=2 x TP=1) against the same node with
cfg_parallel_size: 1. The image is the same within fp32 rounding, and through the real transfer
path (AR packs and writes over Mooncake, the DiT verifies every byte before the ticket is READY)
each DiT rank receives only its CFG row: half the bytes a rank of the cfg 1 replica receives."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvrelay.client import KvRelayClient, TicketState
from kvrelay.models.image import decode_png
from tests.e2e.node import running_node, wait_pools_full

pytestmark = pytest.mark.slow

# Prompt and negative prompt of one length: both rows hold the same pages, so "half" is exact.
PROMPT, NEGATIVE, SEED = "a red fox in the snow", "blurry, low quality!", 77
CONFIG = "test-cfg-parallel.yaml"


def _no_cfg_parallel(cfg: dict[str, Any]) -> None:
    cfg["stages"][1]["cfg_parallel_size"] = 1


def _run(tmp_path: Path, name: str, edit: Any) -> tuple[Any, dict[int, int], Any, Any]:
    with (
        running_node(tmp_path, name, edit, base=CONFIG) as node,
        KvRelayClient(node.address(), timeout=60) as client,
    ):
        result = client.generate(
            PROMPT, negative_prompt=NEGATIVE, seed=SEED, width=64, height=64, timeout=120
        ).result()
        pools = wait_pools_full(client)
        (ticket,) = client.list_tickets([TicketState.RELEASED])
        (dit,) = [r for r in client.list_replicas() if r.role.name == "DIT"]
    per_rank: dict[int, int] = {}
    for w in ticket.writes:
        per_rank[w.dst_rank] = per_rank.get(w.dst_rank, 0) + w.bytes
    return result, per_rank, ticket, (dit, pools)


def test_cfg_parallel_node_image_equals_cfg1_and_halves_bytes_per_rank(tmp_path: Path) -> None:
    # The two nodes run side by side (as in test_topologies.py): one's start-up and stop overlap
    # the other's; neither's bits depend on the other (threads per rank: its own config).
    with ThreadPoolExecutor(2) as pool:
        plain_run = pool.submit(_run, tmp_path, "cfg1", _no_cfg_parallel)
        split_run = pool.submit(_run, tmp_path, "cfg2", None)
        plain, plain_bytes, plain_ticket, (plain_dit, plain_pools) = plain_run.result()
        split, split_bytes, split_ticket, (split_dit, split_pools) = split_run.result()

    assert split_dit.cfg_parallel_size == 2 and plain_dit.cfg_parallel_size == 1
    # Same image: each row computed by its own rank, combined once per step (fp32; the rows are
    # no longer in one batched matmul, so allow one level of rounding).
    a, b = decode_png(plain.png).astype(int), decode_png(split.png).astype(int)
    assert a.shape == b.shape == (64, 64, 3)
    assert int(np.abs(a - b).max()) <= 1
    # Every write was OK and verified on its rank; row r went only to rank r.
    assert {(w.row, w.dst_rank) for w in split_ticket.writes} == {(0, 0), (1, 1)}
    assert {(ld.row, ld.dst_rank) for ld in split_ticket.loads if ld.loaded} == {(0, 0), (1, 1)}
    assert {(w.row, w.dst_rank) for w in plain_ticket.writes} == {(0, 0), (1, 0)}
    # Bytes per DiT rank halve; the total moved is the same.
    assert sorted(split_bytes) == [0, 1] and sorted(plain_bytes) == [0]
    assert split_bytes[0] == split_bytes[1] == plain_bytes[0] // 2 > 0
    # Pages: each group holds only its row (a page pool per group), every page back afterwards.
    pages_per_row = {len(r.page_ids) for r in split_ticket.rows}
    assert len(pages_per_row) == 1 and split_ticket.num_pages == plain_ticket.num_pages
    assert split_pools[0].total_pages == 2 * plain_pools[0].total_pages
