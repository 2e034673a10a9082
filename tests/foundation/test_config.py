"""Config validation: every startup rejection of DESIGN.md sections 6 and 10, errors naming the key."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrelay.config import ConfigError, load_config, parse_config


@pytest.fixture
def base(repo_root: Path) -> dict[str, Any]:
    return yaml.safe_load((repo_root / "configs" / "single-node.yaml").read_text())


def _reject(data: dict[str, Any], *needles: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "test.yaml")
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


# Every file of configs/ but the compose ones (DNS names as advertised hosts: tests/compose loads them).
SHIPPED = ["single-node.yaml", "debug-4gpu.yaml", "reference-8gpu.yaml", "h200-1gpu.yaml", "h200-1gpu-fp8.yaml"]
COMPOSE = ["compose-node.yaml", "compose-node-cpu.yaml"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load(repo_root: Path, name: str) -> None:
    cfg = load_config(repo_root / "configs" / name)
    assert cfg.ar_stage.transfer_timeout == 60.0 or cfg.dit_stage.transfer_timeout == 60.0
    assert cfg.dit_stage.kv_transfer_config is not None
    assert cfg.dit_stage.kv_transfer_config.kv_connector_extra_config["transfer_timeout"] == 60.0


def test_reference_topology_is_the_seeds(repo_root: Path) -> None:
    cfg = load_config(repo_root / "configs" / "reference-8gpu.yaml")
    ar, dit = cfg.ar_stage, cfg.dit_stage
    assert (ar.num_replicas, ar.tensor_parallel_size, dit.num_replicas, dit.tensor_parallel_size) == (2, 2, 2, 2)
    assert [ar.devices_for(r) for r in (0, 1)] == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert [dit.devices_for(r) for r in (0, 1)] == [["cuda:4", "cuda:5"], ["cuda:6", "cuda:7"]]
    assert ar.kv_cache_memory_bytes == 2 * 1024**3 and dit.kv_cache_memory_bytes == 1024**3


def test_test_config_is_fast(repo_root: Path) -> None:
    cfg = load_config(repo_root / "tests" / "configs" / "test-fast.yaml")
    assert cfg.broker.lease_seconds <= 2 and cfg.dit_stage.transfer_timeout <= 5


def test_rejects_other_stage_graph(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    data["edges"] = [{"from": 1, "to": 0}]
    _reject(data, "edges", "AR(0) -> DiT(1)")
    data = copy.deepcopy(base)
    data["stages"].append({**copy.deepcopy(data["stages"][1]), "stage_id": 2})
    _reject(data, "stages", "AR(0) -> DiT(1)")


def test_rejects_async_chunk(base: dict[str, Any]) -> None:
    _reject({**base, "async_chunk": True}, "async_chunk")


def test_rejects_sleep_mode_on_native_dit(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    data["stages"][1]["enable_sleep_mode"] = True
    _reject(data, "enable_sleep_mode", "mapped")
    # Without native transfer (the gRPC fallback) sleep mode is not about registered pages.
    for stage in data["stages"]:
        del stage["kv_transfer_config"]
    assert parse_config(data).dit_stage.enable_sleep_mode


def test_rejects_tp_not_dividing_kv_heads(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    data["stages"][0]["tensor_parallel_size"] = 3
    # Like every config error: the file first (a node reads several), then the key, on one line.
    message = _reject(data, "stages[0].tensor_parallel_size", "num_kv_heads=4")
    assert message.startswith("invalid config test.yaml: stages[0].tensor_parallel_size: ") and "\n" not in message
    data = copy.deepcopy(base)
    data["stages"][1]["sequence_parallel_size"] = 8
    _reject(data, "stages[1].sequence_parallel_size", "num_kv_heads")


def test_several_problems_get_a_line_each(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    data["broker"]["lease_secs"] = 3
    data["broker"]["max_queue"] = "many"
    message = _reject(data, "broker.lease_secs: unknown key", "broker.max_queue")
    assert message.startswith("invalid config test.yaml (2 problems):\n  broker.")
    assert len(message.splitlines()) == 3


def test_rejects_geometry_that_cannot_match(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    data["stages"][1]["model"] = {"preset": "tiny"}
    _reject(data, "geometry differ", "num_layers")
    data = copy.deepcopy(base)
    data["stages"][0]["model"] = {"preset": "small"}
    data["stages"][1]["model"] = {"preset": "small", "dtype": "bfloat16"}
    _reject(data, "geometry differ", "dtype")
    data = copy.deepcopy(base)  # the demo model (the default) against a preset
    data["stages"][1]["model"] = {"preset": "small"}
    _reject(data, "geometry differ", "head_dim")


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), "soon"])
def test_rejects_bad_transfer_timeout(base: dict[str, Any], timeout: Any) -> None:
    data = copy.deepcopy(base)
    data["stages"][1]["kv_transfer_config"]["kv_connector_extra_config"]["transfer_timeout"] = timeout
    _reject(data, "stages.1.kv_transfer_config.kv_connector_extra_config", "transfer_timeout")


def test_an_ar_without_its_own_transfer_timeout_takes_the_dits(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    for stage in data["stages"]:
        stage["kv_transfer_config"]["kv_connector_extra_config"].pop("transfer_timeout", None)
    data["stages"][1]["kv_transfer_config"]["kv_connector_extra_config"]["transfer_timeout"] = 5
    cfg = parse_config(data)
    assert cfg.ar_stage.transfer_timeout == cfg.dit_stage.transfer_timeout == 5.0
    data["stages"][0]["kv_transfer_config"]["kv_connector_extra_config"]["transfer_timeout"] = 9
    cfg = parse_config(data)
    assert (cfg.ar_stage.transfer_timeout, cfg.dit_stage.transfer_timeout) == (9.0, 5.0)  # its own wins


@pytest.mark.parametrize(
    ("path", "key"),
    [((), "bogus"), (("broker",), "lease_secs"), (("stages", 0), "tensor_parallel"), (("stages", 1, "model"), "presett")],
)
def test_rejects_unknown_keys(base: dict[str, Any], path: tuple[Any, ...], key: str) -> None:
    data = copy.deepcopy(base)
    node = data
    for part in path:
        node = node[part]
    node[key] = 1
    _reject(data, key, "unknown key")


# A misspelt key or value names the one it was meant to be, at every level, on the one line that
# names the full key path (it said only "unknown key").
@pytest.mark.parametrize(
    ("path", "key", "line"),
    [
        ((), "securty", "securty: unknown key (did you mean 'security'?)"),
        (("broker",), "lease_secs", "broker.lease_secs: unknown key (did you mean 'lease_seconds'?)"),
        (("security",), "replica_tokns", "security.replica_tokns: unknown key (did you mean 'replica_tokens'?)"),
        (("stages", 1), "max_num_seq", "stages.1.max_num_seq: unknown key (did you mean 'max_num_seqs'?)"),
        (("stages", 0), "tensor_paralel_size",
         "stages.0.tensor_paralel_size: unknown key (did you mean 'tensor_parallel_size'?)"),
        (("stages", 1, "model"), "presett", "stages.1.model.presett: unknown key (did you mean 'preset'?)"),
        (("stages", 0, "kv_transfer_config"), "kv_connecter",
         "stages.0.kv_transfer_config.kv_connecter: unknown key (did you mean 'kv_connector'?)"),
        (("stages", 1, "kv_transfer_config", "kv_connector_extra_config"), "transfer_timout",
         "stages.1.kv_transfer_config.kv_connector_extra_config: unknown key(s) 'transfer_timout' "
         "(did you mean 'transfer_timeout'?); allowed: "),
    ],
)  # fmt: skip
def test_a_misspelt_key_says_which_key_it_meant(
    base: dict[str, Any], path: tuple[Any, ...], key: str, line: str
) -> None:
    data = copy.deepcopy(base)
    data.setdefault("security", {})
    node = data
    for part in path:
        node = node[part]
    node[key] = 1
    message = _reject(data, f"invalid config test.yaml: {line}")
    assert "\n" not in message


def test_a_misspelt_key_inside_tls_says_which_key_it_meant(base: dict[str, Any]) -> None:
    tls = {"cert_file": "c.pem", "key_file": "k.pem", "ca_file": "ca.pem", "server_nme": "x"}
    _reject({**base, "security": {"tls": tls}}, "security.tls.server_nme: unknown key (did you mean 'server_name'?)")


@pytest.mark.parametrize(
    ("path", "value", "line"),
    [
        (("stages", 0, "kv_transfer_config", "kv_connector"), "MoonCakeConnector",
         "stages.0.kv_transfer_config.kv_connector: unknown kv_connector 'MoonCakeConnector' "
         "(did you mean 'MooncakeConnector'?); expected one of "),
        (("stages", 0, "kv_transfer_config", "kv_role"), "kv_produce", "(did you mean 'kv_producer'?)"),
        (("stages", 1, "kind"), "ditt", "stages.1.kind: Input should be 'ar' or 'dit' (did you mean 'dit'?)"),
        (("stages", 1, "kind"), "DIT", "stages.1.kind: Input should be 'ar' or 'dit' (did you mean 'dit'?)"),  # case
        (("stages", 1, "model", "dtype"), "bfloat61", "stages.1.model.dtype: Input should be "),
        (("security", "replica_tokens"), "bund", "security.replica_tokens: Input should be 'shared' or 'bound' (did you mean 'bound'?)"),
        (("stages", 0, "kv_transfer_config", "kv_connector_extra_config", "mooncake_protocol"), "rmda",
         "mooncake_protocol must be 'tcp' or 'rdma' (did you mean 'rdma'?)"),
    ],
)  # fmt: skip
def test_a_misspelt_value_says_which_value_it_meant(
    base: dict[str, Any], path: tuple[Any, ...], value: str, line: str
) -> None:
    data = copy.deepcopy(base)
    data.setdefault("security", {})
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    message = _reject(data, line)
    assert "\n" not in message
    if path[-1] == "dtype":
        assert message.endswith("(did you mean 'bfloat16'?)"), message


def test_a_misspelt_preset_says_which_preset_it_meant(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    data["stages"][0]["model"] = {"preset": "tinny"}
    data["stages"][1]["model"] = {"preset": "tiny"}
    _reject(data, "stages[0].model.preset: unknown model preset 'tinny' (did you mean 'tiny'?); known presets: ")


@pytest.mark.parametrize(("path", "key"), [((), "bogus"), (("stages", 0), "zzzz"), (("broker",), "port_number_x")])
def test_an_unknown_key_close_to_none_suggests_nothing(base: dict[str, Any], path: tuple[Any, ...], key: str) -> None:
    data = copy.deepcopy(base)
    node = data
    for part in path:
        node = node[part]
    node[key] = 1
    assert _reject(data, "unknown key").endswith(f"{key}: unknown key"), key


def test_rejects_unknown_connector_and_mixed_transport(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    data["stages"][0]["kv_transfer_config"]["kv_connector"] = "NixlConnector"
    _reject(data, "kv_connector", "NixlConnector")
    data = copy.deepcopy(base)
    del data["stages"][0]["kv_transfer_config"]
    _reject(data, "kv_transfer_config", "both stages")


def test_fallback_when_transfer_config_absent(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    for stage in data["stages"]:
        del stage["kv_transfer_config"]
    cfg = parse_config(data)
    assert cfg.ar_stage.transport == cfg.dit_stage.transport == "grpc"
    assert cfg.dit_stage.transfer_timeout == 60.0


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_rejects_features_not_in_this_build(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    for stage in data["stages"]:
        stage["kv_transfer_config"]["kv_connector"] = "CudaIpcConnector"
    _reject(data, "CudaIpcConnector", "GPU to GPU")  # the base config runs on the CPU
    for stage in data["stages"]:
        stage["devices"] = "0"
    assert parse_config(data).dit_stage.transport == "cuda_ipc"
    data["stages"][1]["advertise_host"] = "10.0.0.2"
    _reject(data, "CudaIpcConnector", "one host")
    data = copy.deepcopy(base)
    data["stages"][0]["model"] = {"engine": "vllm"}
    _reject(data, "model.path is required")
    data = copy.deepcopy(base)
    data["stages"][0]["model"] = {"preset": "tiny", "vllm_args": {"enforce_eager": True}}
    _reject(data, "vllm_args", "engine: vllm")
    data = copy.deepcopy(base)
    data["stages"][0]["model"] = {"engine": "vllm", "path": "/models/llama", "vllm_args": {"enforce_eager": True}}
    accepted = parse_config(data)
    assert accepted.ar_stage.model.engine == "vllm" and accepted.ar_stage.model.vllm_args == {"enforce_eager": True}


def test_cfg_parallel_size_multiplies_the_dit_ranks_and_is_checked(base: dict[str, Any]) -> None:
    base = copy.deepcopy(base)
    for stage in base["stages"]:
        stage["model"] = {"preset": "tiny"}
    data = copy.deepcopy(base)
    data["stages"][1].update(cfg_parallel_size=2, tensor_parallel_size=4)
    dit = parse_config(data).dit_stage
    # 2 CFG groups of tp 4: 8 ranks, each group's 4 ranks split the 4 kv heads (not 8).
    assert (dit.world_size, dit.head_shards) == (8, 4)
    assert dit.devices_for(0) == ["cpu"] * 8
    data["stages"][1].update(devices="0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15", kv_transfer_config=None)
    data["stages"][0]["kv_transfer_config"] = None
    assert parse_config(data).dit_stage.devices_for(1) == [f"cuda:{d}" for d in range(8, 16)]
    data = copy.deepcopy(base)
    data["stages"][1]["cfg_parallel_size"] = 3
    _reject(data, "stages[1].cfg_parallel_size", "at most 2 CFG rows")
    data["stages"][1]["cfg_parallel_size"] = 0
    _reject(data, "cfg_parallel_size", "greater than or equal to 1")
    data = copy.deepcopy(base)
    data["stages"][0]["cfg_parallel_size"] = 2
    _reject(data, "stages[0].cfg_parallel_size", "the DiT's")
    data = copy.deepcopy(base)
    data["stages"][1].update(cfg_parallel_size=2, model={"format": "demo"})
    _reject(data, "stages[1].cfg_parallel_size", "model.format: kvrelay")
    data = copy.deepcopy(base)
    data["stages"][1].update(cfg_parallel_size=2, sequence_parallel_size=8)
    _reject(data, "stages[1].sequence_parallel_size", "8 rank(s) must divide num_kv_heads=4")


def test_shipped_configs_are_all_checked(repo_root: Path) -> None:
    assert sorted(p.name for p in (repo_root / "configs").glob("*.yaml")) == sorted(SHIPPED + COMPOSE)


def test_fp8_quantization_is_the_dit_stages_only(base: dict[str, Any], repo_root: Path) -> None:
    base = copy.deepcopy(base)
    for stage in base["stages"]:
        stage["model"] = {"preset": "small"}
    assert parse_config(base).dit_stage.model.quantization is None  # off unless asked for
    data = copy.deepcopy(base)
    data["stages"][1]["model"] = {"preset": "small", "quantization": "fp8"}
    cfg = parse_config(data)
    assert cfg.dit_stage.model.quantization == "fp8" and cfg.ar_stage.model.quantization is None
    data["stages"][1]["model"]["dtype"] = "float32"  # the CPU's fp8 GEMM returns fp32 too
    assert parse_config(data).dit_stage.model.quantization == "fp8"
    # the shipped fp8 config differs from its bf16 reference in that one key
    fp8 = load_config(repo_root / "configs" / "h200-1gpu-fp8.yaml")
    ref = load_config(repo_root / "configs" / "h200-1gpu.yaml")
    assert fp8.dit_stage.model.quantization == "fp8" and fp8.ar_stage.model.quantization is None
    assert fp8.dit_stage.model.model_copy(update={"quantization": None}) == ref.dit_stage.model
    assert fp8.model_dump(exclude={"stages"}) == ref.model_dump(exclude={"stages"})
    assert fp8.ar_stage == ref.ar_stage

    data = copy.deepcopy(base)
    data["stages"][0]["model"] = {"preset": "small", "quantization": "fp8"}
    _reject(data, "stages[0].model.quantization", "DiT stage")
    data = copy.deepcopy(base)
    data["stages"][1]["model"] = {"preset": "small", "quantization": "int4"}
    _reject(data, "stages.1.model.quantization", "'fp8'")
    data = copy.deepcopy(base)
    data["stages"][1]["model"] = {"preset": "small", "quantization": "fp8", "dtype": "float16"}
    _reject(data, "stages.1.model", "model.quantization", "not float16")
    # BAGEL-format DiTs quantize their generation expert
    data = copy.deepcopy(base)
    data["stages"][1]["model"] = {"format": "bagel", "path": "/models/BAGEL-7B-MoT", "quantization": "fp8"}
    assert parse_config(data).dit_stage.model.quantization == "fp8"
    data = copy.deepcopy(base)
    for stage in data["stages"]:
        stage["model"] = {"format": "demo"}
    data["stages"][1]["model"]["quantization"] = "fp8"
    cfg = parse_config(data)  # on the CPU the demo's float32 is fine
    assert cfg.dit_stage.model.quantization == "fp8" and cfg.ar_stage.model.quantization is None
    data["stages"][0]["model"]["quantization"] = "fp8"
    _reject(data, "stages[0].model.quantization", "DiT stage")
    del data["stages"][0]["model"]["quantization"]
    data["stages"][1]["devices"] = "0"  # on a GPU the demo's float32 (its kvrelay.json) is not
    _reject(data, "stages[1].model.quantization", "needs bfloat16", "model format demo runs in float32")
    for stage in data["stages"]:
        stage["model"]["dtype"] = "bfloat16"
    assert parse_config(data).dit_stage.model.quantization == "fp8"
    data["stages"][1]["model"]["dtype"] = "float16"
    _reject(data, "stages.1.model", "model.quantization", "not float16")
    data = copy.deepcopy(base)
    for stage in data["stages"]:
        stage["model"] = {"preset": "tiny-moe"}
    data["stages"][1]["model"]["quantization"] = "fp8"
    _reject(data, "stages[1].model.quantization", "dense DiTs only", "'tiny-moe'")


def test_binary_file_is_a_config_error_not_a_traceback(tmp_path: Path) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\x00\xff\xfe garbage")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)


@pytest.mark.parametrize(
    ("path", "value"),
    [(("broker", "port"), True), (("stages", 1, "tensor_parallel_size"), True), (("broker", "lease_seconds"), False)],
)
def test_rejects_booleans_as_numbers(base: dict[str, Any], path: tuple[Any, ...], value: bool) -> None:
    # `port: true` used to pass as port 1 (the broker listened there).
    data = copy.deepcopy(base)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    _reject(data, ".".join(str(p) for p in path), "expected a number")


@pytest.mark.parametrize("devices", ["gpu0", "cuda:x", "0,,1", ""])
def test_rejects_devices_that_are_not_cpu_or_gpu_indices(base: dict[str, Any], devices: str) -> None:
    # "gpu0" became the device "cuda:gpu0", refused by the AR only after the broker was up.
    data = copy.deepcopy(base)
    data["stages"][0]["devices"] = devices
    _reject(data, "stages.0.devices", "GPU indices")
    for accepted in (" 0, 1 ", "cuda:0,cuda:1"):
        data["stages"][0]["devices"] = accepted
        assert parse_config(data).ar_stage.device_list() == ["cuda:0", "cuda:1"]


def test_rejects_empty_hosts(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    data["stages"][1]["advertise_host"] = ""
    _reject(data, "stages.1.advertise_host")
    data = copy.deepcopy(base)
    data["broker"]["host"] = ""
    _reject(data, "broker.host")


def test_rejects_a_dit_without_a_preset(base: dict[str, Any]) -> None:
    # The DiT refused it at start-up, after the broker and the AR were already up.
    data = copy.deepcopy(base)
    for stage in data["stages"]:
        stage["model"] = {"path": "/nonexistent/checkpoint"}
    # A whole-config check names its key itself: no pydantic "<root>" in front of it.
    assert ": stages[1].model.preset: required" in _reject(data, "stages[1].model.preset", "required")


@pytest.mark.parametrize("fmt", [{"format": "demo"}, {"preset": "tiny"}])
@pytest.mark.parametrize("stage", [0, 1])
def test_rejects_stage_memory_smaller_than_one_page(base: dict[str, Any], fmt: dict[str, str], stage: int) -> None:
    # The DiT failed at start-up after the broker and AR were up; an AR this small reported
    # SERVING and failed every request (UNAVAILABLE/TRANSFER_FAILED "needs N staging bytes").
    data = copy.deepcopy(base)
    for each in data["stages"]:
        each["model"] = dict(fmt)
    data["stages"][stage]["kv_cache_memory_bytes"] = 1024
    _reject(data, f"stages[{stage}].kv_cache_memory_bytes", "smaller than one page")


def test_dit_memory_of_exactly_one_page_loads(base: dict[str, Any]) -> None:
    # The demo model: 4 layers x K,V x 4 kv heads x head_dim 16 x 16 tokens x float32 per page.
    page = 4 * 2 * 4 * 16 * 16 * 4
    data = copy.deepcopy(base)
    data["stages"][1]["kv_cache_memory_bytes"] = page
    assert parse_config(data).dit_stage.kv_cache_memory_bytes == page
    data["stages"][1]["kv_cache_memory_bytes"] = page - 1
    _reject(data, "stages[1].kv_cache_memory_bytes", f"({page} bytes per rank")
    # TP=2 halves a rank's page; the AR stages pages of the DiT's page_size.
    data["stages"][1]["tensor_parallel_size"] = 2
    data["stages"][1]["kv_cache_memory_bytes"] = page // 2
    assert parse_config(data).dit_stage.head_shards == 2
    data["stages"][0]["kv_cache_memory_bytes"] = page - 1
    _reject(data, "stages[0].kv_cache_memory_bytes", "at page_size 16")


def test_an_ar_checkpoint_of_another_shape_is_refused_at_load(base: dict[str, Any], tmp_path: Path) -> None:
    """`model: {path: DIR}` on the AR: its config.json's KV shape is checked against the DiT when
    the config loads (the broker refused the AR's registration only after both models loaded),
    on either engine; a directory not on this machine is left to the AR's start."""
    import json

    small = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 256,
             "head_dim": 32}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**small, "num_hidden_layers": 2}))
    data = copy.deepcopy(base)
    data["stages"][0]["model"] = {"path": str(tmp_path)}
    data["stages"][1]["model"] = {"preset": "small"}
    _reject(data, "geometry differ in num_layers (AR 2, DiT 4): the DiT attends over the AR's KV")
    # A checkpoint of a preset's shape is told which DiT preset fits it.
    (tmp_path / "config.json").write_text(json.dumps(small))
    data["stages"][1]["model"] = {"preset": "tiny"}
    _reject(data, "geometry differ in num_layers (AR 4, DiT 2)", "(DiT presets of the AR's shape: small)")
    data["stages"][1]["model"] = {"preset": "small"}
    (tmp_path / "config.json").write_text(json.dumps({**small, "num_hidden_layers": 2}))
    data["stages"][0]["tensor_parallel_size"] = 3
    _reject(data, "stages[0].tensor_parallel_size", f"num_kv_heads=4 of checkpoint {tmp_path}")
    data["stages"][0]["tensor_parallel_size"] = 1
    (tmp_path / "config.json").write_text(json.dumps(small))
    parse_config(data, "test.yaml")  # small's shape, float32 on the CPU like the preset
    data["stages"][0]["model"] = {"path": str(tmp_path), "dtype": "bfloat16"}
    _reject(data, "geometry differ in dtype")
    # engine: vllm runs the checkpoint in the built-in engine's default dtype (vLLM's `auto` picked
    # bfloat16 on CPUs that have it, refused at registration after the engine started): checked here.
    data["stages"][0]["model"] = {"engine": "vllm", "path": str(tmp_path)}
    parse_config(data, "test.yaml")
    data["stages"][1]["model"] = {"preset": "small", "dtype": "bfloat16"}
    _reject(data, "geometry differ in dtype (AR float32, DiT bfloat16): set the same model.dtype on both stages")
    data["stages"][1]["model"] = {"preset": "small"}
    data["stages"][0]["model"] = {"path": str(tmp_path / "elsewhere")}
    parse_config(data, "test.yaml")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 256}))
    data["stages"][0]["model"] = {"path": str(tmp_path)}
    _reject(data, "stages[0].model.path", "not a Llama/Qwen2 config.json")


def test_dit_max_num_seqs_must_fit_the_per_replica_watch_bound(base: dict[str, Any]) -> None:
    cfg = copy.deepcopy(base)
    cfg["stages"][1]["max_num_seqs"] = 8
    cfg.setdefault("broker", {})["max_watch_streams_per_replica"] = 8
    parse_config(cfg)  # equal is enough: one watch per request
    cfg["broker"]["max_watch_streams_per_replica"] = 7
    with pytest.raises(ConfigError, match=r"broker.max_watch_streams_per_replica: 7 is below stages\[1\].max_num_seqs \(8\)"):
        parse_config(cfg)


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("seconds", [1e12, float("inf")])
def test_rejects_a_request_timeout_grpc_cannot_hold(base: dict[str, Any], stage: int, seconds: float) -> None:
    # 1e12 was accepted: every request without a client deadline got a stage call whose deadline
    # lay past 2262, and failed DEADLINE_EXCEEDED at once (found black-box).
    data = copy.deepcopy(base)
    data["stages"][stage]["request_timeout_seconds"] = seconds
    _reject(data, f"stages.{stage}.request_timeout_seconds", "less than or equal to 1000000000")
    data["stages"][stage]["request_timeout_seconds"] = 1e9
    parse_config(data)


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("seconds", [0.1, 0.5, 1.9, float("inf"), float("nan")])
def test_rejects_a_rank_stall_limit_the_liveness_beat_cannot_meet(
    base: dict[str, Any], stage: int, seconds: float
) -> None:
    # 0.1 was accepted, below the beat's own 0.5 s period: the DiT fail-stopped within a second of
    # every start and each request failed REPLICA_FAILED "worker rank 0 silent 0.5s" (found
    # black-box); inf would never notice a stopped rank.
    data = copy.deepcopy(base)
    data["stages"][stage]["rank_stall_seconds"] = seconds
    _reject(data, f"stages.{stage}.rank_stall_seconds")
    data["stages"][stage]["rank_stall_seconds"] = 2.0
    parse_config(data)


@pytest.mark.parametrize(
    ("stage", "fields", "needle"),
    [
        (0, {"port": 65535, "num_replicas": 2}, "stages.0: port: replica 1 of num_replicas 2 would listen on 65536"),
        (1, {"metrics_port": 65534, "num_replicas": 3}, "stages.1: metrics_port: replica 2 of num_replicas 3 would listen on 65536"),
        (1, {"num_replicas": 20000}, "stages.1: port: replica 19999 of num_replicas 20000 would listen on 70070"),
    ],
)
def test_rejects_replica_ports_beyond_65535(base: dict[str, Any], stage: int, fields: dict[str, int], needle: str) -> None:
    # Replica N listens on the stage's base + N: `port: 65535` with 2 replicas loaded, and
    # `kvrelay up` died in an OverflowError traceback binding port 65536 (found black-box).
    data = copy.deepcopy(base)
    data["stages"][stage].update(fields)
    _reject(data, needle)
    # The last port that fits, and port 0 (free ports) with any count, load.
    data["stages"][stage].update({key: 65536 - data["stages"][stage]["num_replicas"] for key in fields if key != "num_replicas"})
    if "num_replicas" in fields and len(fields) == 1:
        data["stages"][stage].update(port=0, metrics_port=0)
    parse_config(data)


def test_an_unknown_kv_connector_names_every_accepted_one(base: dict[str, Any]) -> None:
    data = copy.deepcopy(base)
    data["stages"][0]["kv_transfer_config"]["kv_connector"] = "NixlConnector"
    _reject(data, "NixlConnector", "MooncakeConnector", "CudaIpcConnector", "KvRelayConnector")


@pytest.mark.parametrize("key", ["lease_seconds", "heartbeat_seconds", "drain_quiet_seconds"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_rejects_broker_periods_that_never_end(base: dict[str, Any], key: str, value: float) -> None:
    # `.inf` loaded: a lease that never lapses would keep a replica that is gone UP, and a drain that
    # never ends each cancelled ticket's pages until the pool is empty.
    data = copy.deepcopy(base)
    data["broker"][key] = value
    _reject(data, f"broker.{key}", "finite")


def test_max_replica_retries_defaults_to_one_and_is_bounded(base: dict[str, Any]) -> None:
    assert parse_config(copy.deepcopy(base)).broker.max_replica_retries == 1
    for value in (0, 16):
        data = copy.deepcopy(base)
        data["broker"]["max_replica_retries"] = value
        assert parse_config(data).broker.max_replica_retries == value
    for value, says in ((-1, "greater than or equal to 0"), (17, "less than or equal to 16"), ("once", "integer")):
        data = copy.deepcopy(base)
        data["broker"]["max_replica_retries"] = value
        _reject(data, "broker.max_replica_retries", says)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_rejects_a_rate_limit_that_is_not_a_finite_rate(base: dict[str, Any], value: float) -> None:
    """`.inf` loaded; a rate is a finite number of requests per second."""
    cfg = copy.deepcopy(base)
    cfg.setdefault("security", {})["rate_limit_per_second"] = value
    _reject(cfg, "security.rate_limit_per_second")


def test_a_clients_queue_share_is_part_of_the_queue(base: dict[str, Any]) -> None:
    cfg = copy.deepcopy(base)
    cfg.setdefault("broker", {})["max_queue"] = 10
    assert parse_config(cfg).broker.queue_share_per_client == 8  # default: 3/4, rounded up
    cfg["broker"]["max_queue_per_client"] = 10
    assert parse_config(cfg).broker.queue_share_per_client == 10  # the whole queue: no share
    cfg["broker"]["max_queue_per_client"] = 11
    _reject(cfg, "max_queue_per_client (11) is above max_queue (10)")
    cfg["broker"]["max_queue_per_client"] = 0
    _reject(cfg, "broker.max_queue_per_client")
