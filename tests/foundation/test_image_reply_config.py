"""broker.image_reply_budget_bytes and broker.image_reply_wait_seconds: validated config (an error
names the key), and what the broker's GenerationService uses (the budget's behaviour itself:
tests/orchestrator/test_image_replies.py, which sets it through these keys)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrelay.broker.generation import ImageReplyBudget
from kvrelay.config import ConfigError, parse_config
from tests.orchestrator.harness import cluster


@pytest.fixture
def base(repo_root: Path) -> dict[str, Any]:
    return yaml.safe_load((repo_root / "configs" / "single-node.yaml").read_text())


def _broker(base: dict[str, Any], **keys: Any) -> dict[str, Any]:
    data = copy.deepcopy(base)
    data["broker"].update(keys)
    return data


def test_defaults_are_64_mib_and_10_s(base: dict[str, Any]) -> None:
    broker = parse_config(base, "test.yaml").broker
    assert (broker.image_reply_budget_bytes, broker.image_reply_wait_seconds) == (64 * 1024 * 1024, 10.0)


@pytest.mark.parametrize("value", [0, -1, 1.5, "lots", True, None])
def test_a_bad_budget_is_refused_naming_the_key(base: dict[str, Any], value: Any) -> None:
    with pytest.raises(ConfigError, match=r"broker\.image_reply_budget_bytes"):
        parse_config(_broker(base, image_reply_budget_bytes=value), "test.yaml")


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), 3601, "soon", True])
def test_a_bad_wait_is_refused_naming_the_key(base: dict[str, Any], value: Any) -> None:
    with pytest.raises(ConfigError, match=r"broker\.image_reply_wait_seconds"):
        parse_config(_broker(base, image_reply_wait_seconds=value), "test.yaml")


def test_the_brokers_generation_service_takes_the_configured_bounds(base: dict[str, Any]) -> None:
    cfg = parse_config(_broker(base, image_reply_budget_bytes=256 << 20, image_reply_wait_seconds=2.5), "t.yaml")
    budget = ImageReplyBudget.from_config(cfg.broker)
    assert (budget.limit_bytes, budget.wait_seconds) == (256 << 20, 2.5)

    async def body() -> None:
        async with cluster(image_reply_budget_bytes=3 << 20, image_reply_wait_seconds=0.5) as c:
            assert c.generation is not None
            assert (c.generation.image_budget.limit_bytes, c.generation.image_budget.wait_seconds) == (3 << 20, 0.5)

    asyncio.run(body())
