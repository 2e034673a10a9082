"""Tensor and sequence parallel layers on real rank processes (gloo on CPU), driven through the
worker harness: TP=2 must reproduce TP=1, and Ulysses exchanges must round-trip exactly."""

from __future__ import annotations

import pytest
import torch

from kvrelay.models.parallel import TpGroup
from kvrelay.worker import WorkerGroup
from tests.models.rank_handlers import (
    HIDDEN,
    KV_HEADS,
    AttentionBlock,
    LinearStack,
    ModelsTestHandler,
    SubgroupSums,
    UlyssesRoundTrip,
    run_attention_block,
    run_linear_stack,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2():
    group = WorkerGroup(2, ModelsTestHandler)
    group.start()
    yield group
    group.stop()


def test_linear_stack_tp2_equals_tp1(tp2):
    x = torch.randn(3, 5, HIDDEN, generator=torch.Generator().manual_seed(0))
    reference = run_linear_stack(TpGroup.single(), 11, x)
    outputs = tp2.call_all(LinearStack(11, x))
    for out in outputs:  # row parallel reduces and the last layer gathers: every rank has it all
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_attention_block_tp2_equals_tp1(tp2):
    x = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(1))
    reference, k_full = run_attention_block(TpGroup.single(), 5, x)
    (out0, k0), (out1, k1) = tp2.call_all(AttentionBlock(5, x))
    torch.testing.assert_close(out0, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out1, reference, rtol=1e-5, atol=1e-5)
    # Rank r holds kv heads [r*H/2, (r+1)*H/2): its K is exactly that slice of the TP=1 K.
    assert k0.shape[1] == KV_HEADS // 2
    torch.testing.assert_close(torch.cat([k0, k1], dim=1), k_full, rtol=1e-5, atol=1e-5)


def test_ulysses_all_to_all_round_trips(tp2):
    full = torch.randn(2, 8, 12, 4, generator=torch.Generator().manual_seed(2))  # [B, H, T, D]
    (local0, heads0, back0, gather0), (local1, heads1, back1, gather1) = tp2.call_all(UlyssesRoundTrip(full))
    # Sequence shards -> head shards: rank r holds all tokens of heads [4r, 4r+4).
    assert torch.equal(heads0, full[:, :4])
    assert torch.equal(heads1, full[:, 4:])
    assert torch.equal(gather0, heads0) and torch.equal(gather1, heads1)
    # And back, bit for bit.
    assert torch.equal(back0, local0) and torch.equal(local0, full[:, :, :6])
    assert torch.equal(back1, local1) and torch.equal(local1, full[:, :, 6:])


def test_subgroups_reduce_within_their_ranks(tp2):
    # group_size 1: each rank alone; group_size 2: the whole world (10**0 + 10**1).
    assert tp2.call_all(SubgroupSums(1, strided=False)) == [(0, 1, 1.0), (0, 1, 10.0)]
    assert tp2.call_all(SubgroupSums(1, strided=True)) == [(0, 1, 1.0), (0, 1, 10.0)]
    assert tp2.call_all(SubgroupSums(2, strided=False)) == [(0, 2, 11.0), (1, 2, 11.0)]
