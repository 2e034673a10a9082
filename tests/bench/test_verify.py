"""`kvrelay verify`: the seed's three lines, and a check that can fail."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvrelay.node.verify import run_check


@pytest.mark.slow
def test_verify_prints_exactly_the_seeds_three_lines() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrelay", "verify"], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["prefix_bits_equal True", "attention_bits_equal True", "max_abs_diff 0.0"]


@pytest.mark.slow
def test_verify_tp2_producer_to_ulysses_sp2_consumer() -> None:
    result = run_check("tiny", ar_tp=2, dit_sp=2)
    assert result["prefix_bits_equal"] and result["attention_bits_equal"]
    assert result["max_abs_diff"] == 0.0 and result["bytes"] > 0


@pytest.mark.slow
def test_verify_tp2_producer_to_cfg_parallel_consumer_prints_the_three_lines() -> None:
    """`kvrelay verify --ar-tp 2 --dit-cfg 2`: AR TP=2 -> DiT CFG=2 x TP=1, the seed's three lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvrelay", "verify", "--ar-tp", "2", "--dit-cfg", "2"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["prefix_bits_equal True", "attention_bits_equal True", "max_abs_diff 0.0"]
    # Each CFG group's rank received its row only (the rows differ in length: no exact half here).
    assert "x CFG groups=2" in proc.stderr


@pytest.mark.slow
def test_verify_cfg_parallel_places_rows_by_group_and_detects_a_flipped_byte() -> None:
    result = run_check("tiny", ar_tp=2, dit_tp=2, dit_cfg=2)
    plain = run_check("tiny", ar_tp=2, dit_tp=2)
    assert result["prefix_bits_equal"] and result["attention_bits_equal"] and result["max_abs_diff"] == 0.0
    # Rank g * 2 + s receives row g's head shard s: together the same bytes as the plain replica.
    assert len(result["bytes_per_rank"]) == 4 and sum(result["bytes_per_rank"]) == plain["bytes"]
    assert all(b > 0 for b in result["bytes_per_rank"])
    flipped = run_check("tiny", ar_tp=2, dit_cfg=2, flip_byte_in="mooncake")
    assert flipped["prefix_bits_equal"] is False and flipped["max_abs_diff"] > 0.0


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mooncake", "grpc"])
def test_verify_detects_a_flipped_byte(variant: str) -> None:
    result = run_check("tiny", flip_byte_in=variant)
    assert result["prefix_bits_equal"] is False
    assert result["attention_bits_equal"] is False
    assert result["max_abs_diff"] > 0.0
