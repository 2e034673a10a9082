"""`kvrelay ar` with engine: vllm refuses what it cannot run with a message that says what to fix:
refused vLLM settings (exit 2, before any process starts), a path that is not a model, unknown
engine arguments, and a real vLLM start failure (exit 1, the reason on stderr)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ar_service.harness import write_config
from tests.vllm.checkpoint import build_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _model_dir(path: Path) -> None:
    """A config.json with the `small` DiT's KV geometry, no weights: config load checks a
    checkpoint's geometry against the DiT first, and these tests are about what comes after."""
    from kvrelay.models.presets import get_preset

    ar = get_preset("small").ar
    (path / "config.json").write_text(json.dumps({
        "num_hidden_layers": ar.num_layers, "num_attention_heads": ar.num_heads, "num_key_value_heads": ar.num_kv_heads,
        "head_dim": ar.head_dim, "hidden_size": ar.hidden,
    }))


def _run_ar(
    tmp_path: Path, model: dict[str, Any], timeout: float = 240.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    config = write_config(tmp_path, preset="small")
    data = yaml.safe_load(config.read_text())
    data["stages"][0]["model"] = model
    config.write_text(yaml.safe_dump(data))
    return subprocess.run(
        [sys.executable, "-m", "kvrelay", "ar", "--config", str(config), "--broker", "127.0.0.1:1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )


@pytest.mark.parametrize(
    ("setting", "value"),
    [("enable_prefix_caching", True), ("speculative_config", {"method": "ngram"}), ("enable_sleep_mode", True),
     # An fp8 cache is not the model's dtype: the DiT could not read the KV; refused before vLLM starts.
     ("kv_cache_dtype", "fp8")],
)
def test_refused_vllm_setting_is_named(tmp_path: Path, setting: str, value: Any) -> None:
    _model_dir(tmp_path)
    done = _run_ar(tmp_path, {"engine": "vllm", "path": str(tmp_path), "vllm_args": {setting: value}})
    assert done.returncode == 2, done.stderr
    assert f"vllm_args.{setting}" in done.stderr


def test_tensor_parallel_is_refused(tmp_path: Path) -> None:
    _model_dir(tmp_path)
    config = write_config(tmp_path, preset="small", ar_tp=2)
    data = yaml.safe_load(config.read_text())
    data["stages"][0]["model"] = {"engine": "vllm", "path": str(tmp_path)}
    config.write_text(yaml.safe_dump(data))
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay", "ar", "--config", str(config), "--broker", "127.0.0.1:1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "stages[0].tensor_parallel_size" in done.stderr


def test_not_a_model_directory(tmp_path: Path) -> None:
    done = _run_ar(tmp_path, {"engine": "vllm", "path": str(tmp_path / "nothing")})
    assert done.returncode == 2, done.stderr
    assert "stages[0].model.path" in done.stderr and "is not a model directory (no config.json)" in done.stderr


def test_a_model_directory_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    """Refused before vLLM starts (vLLM's own error came after ~20 s, its reason on lines the node
    did not print: "Couldn't instantiate the backend tokenizer from one of: ")."""
    _model_dir(tmp_path)
    done = _run_ar(tmp_path, {"engine": "vllm", "path": str(tmp_path)})
    assert done.returncode == 2, done.stderr
    assert f"stages[0].model.path: {str(tmp_path)!r} has no tokenizer" in done.stderr
    assert "set model.tokenizer" in done.stderr


def test_a_start_failure_is_one_line() -> None:
    from kvrelay.ar_service.vllm_engine import start_failure

    exc = ValueError("Couldn't instantiate the backend tokenizer from one of: \n(1) a file, \n(2) a class.")
    assert start_failure("/m", exc) == (
        "vLLM failed to start for /m: ValueError: Couldn't instantiate the backend tokenizer from one of: "
        "(1) a file, (2) a class."
    )


def test_a_cache_too_small_for_max_model_len_names_kvrelays_settings() -> None:
    """vLLM said "0.0 GiB KV cache is needed, which is larger than the available KV cache memory
    (0.0 GiB) ... Try increasing `gpu_memory_utilization`" for kv_cache_memory_bytes 2 MiB and
    max_model_len 1024 (black-box, kvrelay up): that setting does nothing on CPU here."""
    from kvrelay.ar_service.vllm_engine import start_failure

    exc = ValueError(
        "To serve at least one request with the model's max seq len (1024), (0.0 GiB KV cache is needed, "
        "which is larger than the available KV cache memory (0.0 GiB). Try increasing `gpu_memory_utilization`"
    )
    line = start_failure("/m", exc)
    assert line.startswith(
        "vLLM failed to start for /m: vLLM's KV cache cannot hold one request of max_model_len tokens: on "
        "CPU its size is VLLM_CPU_KVCACHE_SPACE (GiB, kvrelay's default 1) or "
        "stages[0].model.vllm_args.kv_cache_memory_bytes, not gpu_memory_utilization"
    )
    assert "(ValueError: To serve at least one request" in line and "\n" not in line


@pytest.mark.slow
def test_vllm_start_failure_is_reported(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    ckpt = build_checkpoint(tmp_path / "ckpt")
    # vLLM itself refuses: a context longer than the checkpoint's 1024 positions.
    done = _run_ar(tmp_path, {"engine": "vllm", "path": str(ckpt), "vllm_args": {"max_model_len": 100000}})
    assert done.returncode == 1, done.stderr
    assert "vLLM failed to start for" in done.stderr and "max_model_len" in done.stderr


def test_vllm_runs_the_builtin_engines_dtype_unless_set(tmp_path: Path) -> None:
    """Without model.dtype vLLM is given float32 on the CPU (what the config checks against the
    DiT), not its own `auto`: that picked bfloat16 for a float32 checkpoint on a CPU with bf16, and
    the broker refused the AR (GEOMETRY_MISMATCH) only after the engine had started."""
    from kvrelay.ar_service.vllm_engine import vllm_rank_spec
    from kvrelay.config import load_config

    _model_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    config = write_config(tmp_path, preset="small")
    data = yaml.safe_load(config.read_text())
    data["stages"][0]["model"] = {"engine": "vllm", "path": str(tmp_path)}
    config.write_text(yaml.safe_dump(data))
    stage = load_config(config).stages[0]
    assert vllm_rank_spec(stage).engine_kwargs()["dtype"] == "float32"
    data["stages"][0]["model"]["dtype"] = "bfloat16"
    data["stages"][1]["model"]["dtype"] = "bfloat16"
    config.write_text(yaml.safe_dump(data))
    assert vllm_rank_spec(load_config(config).stages[0]).engine_kwargs()["dtype"] == "bfloat16"


def test_engine_vllm_on_gpu_devices_is_refused_at_load(tmp_path: Path) -> None:
    """KvRelayConnector reads vLLM's CPU block layout only: a GPU config was accepted and vLLM
    refused the connector when it registered the cache, after loading the model."""
    from kvrelay.config import ConfigError, load_config

    _model_dir(tmp_path)
    config = write_config(tmp_path, preset="small")
    data = yaml.safe_load(config.read_text())
    data["stages"][0]["model"] = {"engine": "vllm", "path": str(tmp_path), "dtype": "float32"}
    for stage in data["stages"]:
        stage["devices"] = "0"
        stage["model"]["dtype"] = "float32"
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"stages\[0\].devices: '0': engine: vllm runs on vLLM's CPU platform only"):
        load_config(config)
    data["stages"][0]["devices"] = "cpu"
    config.write_text(yaml.safe_dump(data))
    assert load_config(config).ar_stage.model.engine == "vllm"


def test_an_unsupported_cpu_attention_kernel_names_its_real_cause() -> None:
    """vLLM's CPU attention runs its 'vec16' kernel for a head_dim that is a multiple of 16 but not
    of 32 (80, 112, 160, 224): the connector refused it telling the user to change the dtype."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    import torch

    from kvrelay.ar_service.vllm_connector import KvRelayConnector

    fake = SimpleNamespace(_vllm_config=SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto")), _block_size=128)
    with pytest.raises(NotImplementedError) as info:
        KvRelayConnector._check_cpu_isa(fake, torch.empty(1, 1, 128, 2 * 80))  # type: ignore[arg-type]
    message = str(info.value)
    assert "'vec16'" in message and "head_dim 80" in message and "not a multiple of 32" in message
    assert "float32 or float16" not in message
    KvRelayConnector._check_cpu_isa(fake, torch.empty(1, 1, 128, 2 * 32))  # type: ignore[arg-type]  # 'vec': read


def _vllm_config(tmp_path: Path, vllm_args: dict[str, Any] | None = None) -> Path:
    _model_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    config = write_config(tmp_path, preset="small")
    data = yaml.safe_load(config.read_text())
    data["stages"][0]["model"] = {"engine": "vllm", "path": str(tmp_path), "vllm_args": vllm_args or {}}
    config.write_text(yaml.safe_dump(data))
    return config


@pytest.mark.parametrize("value", ["1.5", "512MiB", "0", "-1", "2GiB", "²"])
def test_a_kvcache_space_vllm_cannot_read_is_refused_when_the_config_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """vLLM reads VLLM_CPU_KVCACHE_SPACE with int() deep in its start: `1.5` or `512MiB` was a
    vLLM traceback after the model load; 0 was no cache at all."""
    from kvrelay.config import ConfigError, load_config

    config = _vllm_config(tmp_path)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    with pytest.raises(ConfigError) as info:
        load_config(config)
    message = str(info.value)
    assert f"VLLM_CPU_KVCACHE_SPACE={value!r}" in message and "whole number of GiB" in message
    assert "vllm_args.kv_cache_memory_bytes" in message


def test_kvcache_space_accepted_values_and_kv_cache_memory_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvrelay.ar_service.vllm_engine import engine_env
    from kvrelay.config import ConfigError, load_config

    config = _vllm_config(tmp_path)
    for value, passed in ((" 3 ", "3"), ("", "1"), (None, "1"), ("16", "16")):
        if value is None:
            monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        else:
            monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
        stage = load_config(config).ar_stage
        assert engine_env(stage.model.vllm_args)["VLLM_CPU_KVCACHE_SPACE"] == passed
    # A cache that is not whole GiB: vLLM's own setting in bytes, and no variable to override it.
    config = _vllm_config(tmp_path, {"kv_cache_memory_bytes": 512 << 20})
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    stage = load_config(config).ar_stage
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine_env(stage.model.vllm_args)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    both = r"VLLM_CPU_KVCACHE_SPACE='2' and stages\[0\].model.vllm_args.kv_cache_memory_bytes both"
    with pytest.raises(ConfigError, match=both):
        load_config(config)
    with pytest.raises(ConfigError, match="both size vLLM's KV cache"):
        engine_env({"kv_cache_memory_bytes": 512 << 20})


def test_kvrelay_ar_with_a_fractional_kvcache_space_exits_2_naming_it(tmp_path: Path) -> None:
    _model_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    done = _run_ar(tmp_path, {"engine": "vllm", "path": str(tmp_path)}, env={"VLLM_CPU_KVCACHE_SPACE": "1.5"})
    assert done.returncode == 2, done.stderr
    assert "VLLM_CPU_KVCACHE_SPACE='1.5': vLLM reads it as a whole number of GiB" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("value", ["512MiB", "0.5", 0, -1, 1.5, True])
def test_kv_cache_memory_bytes_must_be_bytes(value: Any) -> None:
    """Handed to vLLM's EngineArgs as given, where only an int of bytes works (its CLI's "512M"
    does not)."""
    from kvrelay.ar_service.vllm_engine import check_vllm_args
    from kvrelay.config import ConfigError

    refused = r"vllm_args.kv_cache_memory_bytes: .*: vLLM's KV cache size in bytes"
    with pytest.raises(ConfigError, match=refused):
        check_vllm_args({"kv_cache_memory_bytes": value})
    check_vllm_args({"kv_cache_memory_bytes": 512 << 20})
    check_vllm_args({"kv_cache_memory_bytes": "536870912"})  # vLLM reads the digits too
