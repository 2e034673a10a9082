"""How a node shares one host's cores between its CPU ranks (cpu_share_env)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrelay.config import parse_config
from kvrelay.node.supervisor import cpu_share_env


@pytest.fixture
def single_node(repo_root: Path) -> dict[str, Any]:
    return yaml.safe_load((repo_root / "configs" / "single-node.yaml").read_text())


def _share(data: dict[str, Any], **kwargs: Any) -> dict[str, str]:
    return cpu_share_env(parse_config(data), **kwargs)


def _stage(data: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(s for s in data["stages"] if s["kind"] == kind)


def test_the_stages_take_turns_so_each_gets_every_core(single_node, monkeypatch):
    monkeypatch.delenv("KVRELAY_THREADS_PER_RANK", raising=False)
    cores = len(os.sched_getaffinity(0))
    # One AR rank and one DiT rank: a request's prefill, then its denoise. The DiT does nearly
    # all the work; halving the cores between the stages left it half the host.
    assert _share(single_node) == {"KVRELAY_THREADS_PER_RANK": str(cores)}
    # Ranks of one stage compute together: they split the cores.
    tp2 = copy.deepcopy(single_node)
    _stage(tp2, "ar")["tensor_parallel_size"] = 2
    assert _share(tp2) == {"KVRELAY_THREADS_PER_RANK": str(max(1, cores // 2))}
    replicas = copy.deepcopy(single_node)
    _stage(replicas, "dit")["num_replicas"] = 3
    assert _share(replicas) == {"KVRELAY_THREADS_PER_RANK": str(max(1, cores // 3))}
    # A node that runs only the AR role counts only its ranks.
    assert _share(replicas, roles=("broker", "ar")) == {"KVRELAY_THREADS_PER_RANK": str(cores)}
    assert _share(single_node, roles=("broker",)) == {}


def test_gpu_stages_and_an_explicit_setting_are_left_alone(single_node, monkeypatch):
    monkeypatch.delenv("KVRELAY_THREADS_PER_RANK", raising=False)
    gpu = copy.deepcopy(single_node)
    for stage in gpu["stages"]:
        stage["devices"] = "cuda:0"
    assert _share(gpu) == {}
    monkeypatch.setenv("KVRELAY_THREADS_PER_RANK", "1")
    assert _share(single_node) == {}
