"""BAGEL-format checkpoints sharded on load: TP ranks of the AR and TP x SP ranks of the DiT
(real processes and process groups) compute what one process does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.models.bagel import build_ar
from kvrelay.models.bagel_runner import BagelDitRunner
from kvrelay.models.tokenizer import BagelTokenizer
from kvrelay.worker import WorkerGroup

from .rank_handlers import BagelRankFactory, Denoise, Prefill
from .tiny import write_tiny_bagel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bagel(tmp_path_factory.mktemp("bagel-par") / "BAGEL-tiny", seed=7)


def test_ar_tp2_prefill_is_the_full_models_head_shards(tiny_dir: Path) -> None:
    ids = BagelTokenizer(tiny_dir).encode("a green triangle on the black background bottom left")
    full = build_ar(tiny_dir).prefill(ids)
    with WorkerGroup(2, BagelRankFactory(str(tiny_dir), "ar")) as group:
        shards = group.call_all(Prefill(tuple(ids)), timeout_s=180)
    torch.testing.assert_close(torch.cat(shards, dim=2), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp, sp", [(1, 2), (2, 2)])
def test_dit_tp_sp_denoise_matches_one_process(tiny_dir: Path, tp: int, sp: int) -> None:
    tok = BagelTokenizer(tiny_dir)
    ar = build_ar(tiny_dir)
    rows = []
    for text in ("a red circle on the blue background top left", ""):
        kv = ar.prefill(tok.encode(text))
        rows.append([(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])])
    # 6 x 4 latent tokens + 2 markers = 26 query tokens: SP=2 splits the markers across ranks.
    command = Denoise(rows, width=24, height=16, steps=2, guidance_scale=3.0, seed=11)
    ref = BagelDitRunner(tiny_dir).denoise(
        rows, width=24, height=16, steps=2, guidance_scale=3.0, seed=11
    )
    with WorkerGroup(tp * sp, BagelRankFactory(str(tiny_dir), "dit", tp, sp)) as group:
        results = group.call_all(command, timeout_s=300)
    for latents in results:
        torch.testing.assert_close(latents, ref, atol=1e-4, rtol=1e-4)
