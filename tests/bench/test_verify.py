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
@pytest.mark.parametrize("variant", ["mooncake", "grpc"])
def test_verify_detects_a_flipped_byte(variant: str) -> None:
    result = run_check("tiny", flip_byte_in=variant)
    assert result["prefix_bits_equal"] is False
    assert result["attention_bits_equal"] is False
    assert result["max_abs_diff"] > 0.0
