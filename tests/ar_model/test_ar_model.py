"""The built-in AR decoder: prefill shape and determinism, TP=1 vs TP=2 on real ranks, bad input."""

from __future__ import annotations

import functools

import pytest
import torch

from kvrelay.models.ar import ArModel, PromptTooLong, build_ar_model, pack_rows, packed_inputs, token_bucket
from kvrelay.models.layers import apply_rotary, rope_cos_sin
from kvrelay.models.parallel import TpGroup
from kvrelay.models.presets import get_preset
from kvrelay.models.tokenizer import ByteTokenizer
from kvrelay.worker import WorkerCommandError, WorkerGroup
from tests.ar_model.ar_handlers import ArPrefillHandler, Prefill

PROMPT = "a watercolor fox asleep under a paper lantern"


def test_prefill_shape_and_dtype():
    preset = get_preset("tiny")
    ids = ByteTokenizer().encode(PROMPT)
    kv = build_ar_model(preset="tiny", seed=0).prefill(ids)
    assert kv.shape == (preset.num_layers, 2, preset.num_kv_heads, len(ids), preset.head_dim)
    assert kv.dtype == torch.float32 and torch.isfinite(kv).all()


def test_prefill_is_deterministic_for_a_seed():
    ids = ByteTokenizer().encode(PROMPT)
    a = build_ar_model(preset="tiny", seed=3).prefill(ids)
    b = build_ar_model(preset="tiny", seed=3).prefill(ids)
    assert torch.equal(a, b)
    assert not torch.equal(a, build_ar_model(preset="tiny", seed=4).prefill(ids))


def test_prefill_is_causal_a_prefix_prompt_gives_the_prefix_kv():
    ids = ByteTokenizer().encode(PROMPT)
    model = build_ar_model(preset="tiny", seed=3)
    full, head = model.prefill(ids), model.prefill(ids[:10])
    torch.testing.assert_close(full[..., :10, :], head, rtol=1e-5, atol=1e-5)


def test_packed_rows_give_each_row_its_own_kv():
    # The GPU prefill packs rows into one sequence (positions restart per row, attention stays
    # within a row); the same forward on the CPU gives every row the K/V of its own prefill.
    model = build_ar_model(preset="tiny", seed=5)
    rows = [torch.tensor(ByteTokenizer().encode(text)) for text in (PROMPT, "low quality", "x")]
    total = sum(int(r.numel()) for r in rows)
    ids, positions, segments = packed_inputs(rows, total + 13)  # 13 tokens of padding at the end
    kv = torch.empty(model.kv_shape(1, ids.shape[1]), dtype=model.dtype)
    model.forward_kv(ids, kv, positions, segments)
    start = 0
    for row in rows:
        n = int(row.numel())
        torch.testing.assert_close(kv[:, :, 0, :, start : start + n], model.prefill(row), rtol=1e-5, atol=1e-5)
        start += n
    # Without the segments the second row would attend to the first: different K/V.
    leaky = torch.empty_like(kv)
    model.forward_kv(ids, leaky, positions)
    n0 = int(rows[0].numel())
    assert not torch.allclose(leaky[1:, :, 0, :, n0 : n0 + 3], kv[1:, :, 0, :, n0 : n0 + 3], atol=1e-3)


def test_packing_and_buckets():
    assert pack_rows([96, 16, 96, 16], 1024) == [[0, 1, 2, 3]]
    assert pack_rows([600, 500, 3000, 20, 30], 1024) == [[0], [1], [2], [3, 4]]
    assert pack_rows([], 1024) == []
    assert [token_bucket(n, 4096) for n in (1, 64, 65, 96, 97, 112, 192, 193, 1000, 3700, 5000)] == [
        64, 64, 96, 96, 128, 128, 192, 256, 1024, 4096, 4096,
    ]
    ids, positions, segments = packed_inputs([torch.tensor([7, 8, 9]), torch.tensor([4])], 6)
    assert ids.tolist() == [[7, 8, 9, 4, 0, 0]]
    assert positions.tolist() == [0, 1, 2, 0, 4, 5] and segments.tolist() == [0, 0, 0, 1, 2, 2]
    with pytest.raises(ValueError, match="do not fit"):
        packed_inputs([torch.tensor([1, 2, 3])], 2)


def test_k_is_stored_after_rope():
    # Layer 0's K is k_proj(norm(embed)) rotated by its position; undoing the rotation at the
    # token's position must give the same projection for the same token at two positions.
    model = build_ar_model(preset="tiny", seed=3)
    cfg = model.config
    ids = [65] * 6
    k = model.prefill(ids)[0, 0]  # [H, T, D]
    cos, sin = rope_cos_sin(torch.arange(6), cfg.head_dim, cfg.rope_theta)
    unrotated = apply_rotary(k, cos, -sin)  # rotation by -angle
    torch.testing.assert_close(unrotated[:, 0], unrotated[:, 5], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(k[:, 0], k[:, 5], atol=1e-3)


def test_bad_prompts_are_rejected_before_any_work():
    model = build_ar_model(preset="tiny", seed=0)
    with pytest.raises(PromptTooLong, match="max is 256"):
        model.prefill([1] * 257)
    with pytest.raises(ValueError, match="no tokens"):
        model.prefill([])
    with pytest.raises(ValueError, match="token ids must be in"):
        model.prefill([1, 400])


def test_tp_must_divide_kv_heads():
    with pytest.raises(ValueError, match="does not divide num_kv_heads"):
        ArModel(get_preset("tiny").ar, TpGroup(0, 3))


def test_prefill_bfloat16():
    kv = build_ar_model(preset="tiny", seed=0, dtype="bfloat16").prefill([1, 2, 3])
    assert kv.dtype == torch.bfloat16
    ref = build_ar_model(preset="tiny", seed=0).prefill([1, 2, 3])
    torch.testing.assert_close(kv.float(), ref, rtol=0.1, atol=0.1)


@pytest.mark.slow
def test_tp2_prefill_equals_tp1_and_tp1_rank_equals_local(tmp_path):
    ids = tuple(ByteTokenizer().encode(PROMPT))
    local = build_ar_model(preset="tiny", seed=9).prefill(list(ids))
    heads = get_preset("tiny").num_kv_heads
    with WorkerGroup(2, functools.partial(ArPrefillHandler, preset="tiny", seed=9)) as tp2:
        kv0, kv1 = tp2.call_all(Prefill(ids))
        assert kv0.shape[2] == kv1.shape[2] == heads // 2
        # Rank r holds kv heads [r*H/2, (r+1)*H/2); reductions differ in order, hence tolerance.
        torch.testing.assert_close(torch.cat([kv0, kv1], dim=2), local, rtol=1e-4, atol=1e-4)
        with pytest.raises(WorkerCommandError, match="PromptTooLong"):
            tp2.call_all(Prefill((1,) * 300))
        # Same tokens again on the same ranks: bit for bit.
        again = tp2.call_all(Prefill(ids))
        assert torch.equal(again[0], kv0) and torch.equal(again[1], kv1)
    # A TP=1 rank process (own thread count, own process) reproduces the local prefill exactly:
    # what the AR service sends is what a local prefill computes.
    with WorkerGroup(1, functools.partial(ArPrefillHandler, preset="tiny", seed=9)) as tp1:
        (remote,) = tp1.call_all(Prefill(ids))
    assert torch.equal(remote, local)
