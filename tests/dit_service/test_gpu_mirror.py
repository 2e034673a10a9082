"""GPU page memory: transports write the pinned host mirror; the rank copies a ticket's pages to
its device pool at identical offsets and denoises from there. Same image as the dense prefix on
the same GPU."""

from __future__ import annotations

import pytest
import torch

from kvrelay.dit_service.engine import DitRankHandler, DitRankSpec, RunDenoise, control_bytes
from kvrelay.dit_service.memory import HostPool, ReplicaMemory, dit_geometry
from kvrelay.models.dit import DitRunner, random_prefix
from kvrelay.models.paged_attention import write_prefix
from kvrelay.models.parallel import TpGroup
from kvrelay.models.presets import get_preset
from kvrelay.transfer.layout import PageLayout
from kvrelay.transfer.planner import RowSpec
from kvrelay.worker import RankContext

pytestmark = pytest.mark.gpu


def test_pinned_mirror_to_device_pool() -> None:
    preset = get_preset("tiny")
    geometry = dit_geometry(preset, 16)
    memory = ReplicaMemory(geometry, 1, 1 << 20, tag="test-gpu")
    control = HostPool.create(0, control_bytes(1), "test-gpu-control")
    spec = DitRankSpec(preset="tiny", weight_seed=0, dtype="float32", tp=1, sp=1, page_size=16,
                       num_pages=memory.num_pages, pools=tuple(memory.specs()), control=control.spec, slots=1,
                       transport="grpc")
    ctx = RankContext(0, 1, "cuda:0", "nccl", 4, TpGroup.single())
    handler = DitRankHandler(ctx, spec)
    try:
        assert handler.device_pool is not None and handler.device_pool.is_cuda
        assert handler._pinned, "the host mirror should be page-locked for async copies"
        rows = [RowSpec(0, 29, (7, 3)), RowSpec(1, 4, (11,))]
        prefixes = [random_prefix(preset, r.num_tokens, seed=40 + r.row) for r in rows]
        layout = PageLayout(geometry, 1, 0)
        host = HostPool.attach(memory.specs()[0]).tensor()
        for r, p in zip(rows, prefixes, strict=True):
            write_prefix(host, layout, r.page_ids, p)  # what a transfer leaves in the mirror
        result = handler.handle(RunDenoise(0, 1, tuple(rows), 64, 64, 3, 2.0, 5))
        assert not result.cancelled and result.steps_done == 3 and result.pixels is not None
        for r in rows:
            for page in r.page_ids:
                lo, hi = page * layout.page_bytes, (page + 1) * layout.page_bytes
                assert torch.equal(handler.device_pool[lo:hi].cpu(), host[lo:hi])  # identical offsets
        local = DitRunner("tiny", device="cuda:0", dtype=torch.float32).generate(
            [[(k.cuda(), v.cuda()) for k, v in p] for p in prefixes],
            width=64, height=64, steps=3, guidance_scale=2.0, seed=5).numpy().astype(int)
        assert int(abs(result.pixels.astype(int) - local).max()) <= 1
    finally:
        handler.close()
        memory.close()
        control.close()
