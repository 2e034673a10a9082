"""A transferred prefix is the same prefix, bit for bit: KV written by a real Mooncake sender into
the DiT's page memory (registered by a real rank worker, as the service does), read back through
the service's read path, gives attention outputs identical to the dense local prefix
(`prefix_bits_equal`, `attention_bits_equal`, `max_abs_diff 0.0`, as the seed reports)."""

from __future__ import annotations

import torch

from kvrelay.dit_service.engine import DescribeRegion, DitRankSpec, VerifyWrites, control_bytes
from kvrelay.dit_service.memory import HostPool, ReplicaMemory, dit_geometry, num_pages_for
from kvrelay.models.dit import random_prefix
from kvrelay.models.paged_attention import prefix_attention, read_prefix
from kvrelay.models.presets import get_preset
from kvrelay.transfer.layout import PageLayout
from kvrelay.transfer.pack import pack_staging
from kvrelay.transfer.planner import RowSpec, plan_transfer, staging_bytes
from kvrelay.transfer.transport import make_sender
from kvrelay.worker import WorkerGroup
from tests.dit_service.harness import shared_staging


def test_memory_sizing_from_kv_cache_memory_bytes() -> None:
    geometry = dit_geometry(get_preset("small"), 16)
    one = PageLayout(geometry, 1, 0)
    two = PageLayout(geometry, 2, 1)
    assert num_pages_for(128 << 20, one) == (128 << 20) // one.page_bytes
    # Each TP rank stores half the heads: pages are half as big, so twice as many fit per worker.
    assert num_pages_for(128 << 20, two) == 2 * num_pages_for(128 << 20, one)
    memory = ReplicaMemory(geometry, 2, 1 << 20, tag="test-sizing")
    try:
        assert memory.num_pages == (1 << 20) // two.page_bytes
        assert all(len(memory.region(r)) == memory.num_pages * two.page_bytes for r in range(2))
        assert memory.page_ranges([3, 1, 2, 7]) == [(1 * two.page_bytes, 4 * two.page_bytes),
                                                    (7 * two.page_bytes, 8 * two.page_bytes)]
    finally:
        memory.close()


def test_transferred_prefix_attention_is_bit_exact() -> None:
    preset = get_preset("tiny")
    geometry = dit_geometry(preset, 16)
    memory = ReplicaMemory(geometry, 1, 1 << 20, tag="test-bits")
    control = HostPool.create(-1, control_bytes(1), "test-bits-control")
    spec = DitRankSpec(preset="tiny", weight_seed=0, dtype=None, tp=1, sp=1, page_size=16,
                       num_pages=memory.num_pages, pools=tuple(memory.specs()), control=control.spec, slots=1,
                       transport="mooncake")
    group = WorkerGroup(1, spec, name="test-dit-bits")
    try:
        group.start()
        [region] = group.call_all(DescribeRegion())
        assert region.transport == "mooncake" and region.length == len(memory.region(0))

        # Two CFG rows; row 0 on non-contiguous pages, lengths not a multiple of page_size.
        counts = {0: 37, 1: 9}
        rows = [RowSpec(0, 37, (9, 4, 5)), RowSpec(1, 9, (1,))]
        prefixes = {row: random_prefix(preset, n, seed=100 + row) for row, n in counts.items()}
        kv_by_row = {row: torch.stack([torch.stack([k, v]) for k, v in p]) for row, p in prefixes.items()}
        plan = plan_transfer(geometry, 1, 1, rows)
        staging = shared_staging()[: staging_bytes(plan, 0)]
        pack_staging(staging, kv_by_row, geometry, 1, 1, rows, plan, 0)
        outcomes = make_sender("mooncake").write(staging, plan, {0: region}, "bits", 10.0)
        assert all(o.ok for o in outcomes), outcomes
        # The rank's own verification agrees with the sender's checksum.
        assert group.call_all(VerifyWrites(plan))[0] == [o.checksum for o in outcomes]

        pool = HostPool.attach(memory.specs()[0]).tensor()  # what the rank's read path reads
        layout = PageLayout(geometry, 1, 0)
        gen = torch.Generator().manual_seed(0)
        heads_q, n = preset.dit.num_heads, 24
        q = torch.randn(2, heads_q, n, geometry.head_dim, generator=gen)
        k = torch.randn(2, geometry.num_kv_heads, n, geometry.head_dim, generator=gen)
        v = torch.randn(2, geometry.num_kv_heads, n, geometry.head_dim, generator=gen)
        paged = [read_prefix(pool, layout, r.page_ids, r.num_tokens) for r in rows]
        for layer in range(geometry.num_layers):
            for row in (0, 1):
                for got, want in zip(paged[row][layer], prefixes[row][layer], strict=True):
                    assert torch.equal(got, want)  # prefix_bits_equal
            out_paged = prefix_attention(q, k, v, [paged[r][layer] for r in (0, 1)])
            out_local = prefix_attention(q, k, v, [prefixes[r][layer] for r in (0, 1)])
            assert torch.equal(out_paged.view(torch.int32), out_local.view(torch.int32))  # attention_bits_equal
            assert float((out_paged - out_local).abs().max()) == 0.0  # max_abs_diff 0.0
    finally:
        group.stop()
        memory.close()
        control.close()
