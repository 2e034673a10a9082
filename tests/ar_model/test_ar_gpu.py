"""AR prefill on a GPU: bf16 TP=2 with both ranks on one GPU (gloo, collectives staged through
host memory) against TP=1 on the same GPU."""

from __future__ import annotations

import functools

import pytest
import torch

from kvrelay.models.ar import build_ar_model
from kvrelay.worker import WorkerGroup
from tests.ar_model.ar_handlers import ArPrefillHandler, Prefill

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_tp2_sharing_one_gpu_equals_tp1_bf16():
    ids = tuple(range(1, 200))
    local = build_ar_model(preset="tiny", seed=2, device="cuda:0", dtype="bfloat16").prefill(list(ids))
    factory = functools.partial(ArPrefillHandler, preset="tiny", seed=2, dtype="bfloat16")
    with WorkerGroup(2, factory, devices=["cuda:0", "cuda:0"]) as group:
        assert group.backend == "gloo"
        kv0, kv1 = group.call_all(Prefill(ids))
    assert kv0.device.type == "cuda" and kv0.dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat([kv0, kv1], dim=2).float(), local.float(), rtol=3e-2, atol=3e-2)
