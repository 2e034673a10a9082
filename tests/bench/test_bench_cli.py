"""`kvrelay bench`'s inputs, in process and before any node starts: which config it reads
($KVRELAY_CONFIG as every subcommand, an explicit --config first) and one clear line, exit 2, for
input it cannot use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvrelay.config import load_config
from kvrelay.node import bench
from kvrelay.node.cli import main


class _Started(Exception):
    """Raised in place of the first scenario: the inputs were accepted."""


@pytest.fixture
def scenario_base(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The base config the bench would have run its first scenario on (nothing is started)."""
    seen: dict[str, Any] = {}

    def stop(args: Any, workload: Any, impls: Any, base: dict[str, Any], workdir: Path) -> Any:
        seen.update(base)
        raise _Started

    monkeypatch.setattr(bench, "run_scenario", stop)
    return seen


def _bench(tmp_path: Path, *extra: str) -> int:
    return main(["bench", "--preset", "tiny", "--output", str(tmp_path / "out"), *extra])


def test_bench_reads_the_config_named_by_kvrelay_config(
    repo_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scenario_base: dict[str, Any]
) -> None:
    fast = repo_root / "tests/configs/test-fast.yaml"
    monkeypatch.setenv("KVRELAY_CONFIG", str(fast))
    with pytest.raises(_Started):
        _bench(tmp_path)
    # test-fast's broker (port 0, a 2 s lease), not the shipped single-node config's (50051, 10 s).
    assert scenario_base["broker"] == load_config(fast).broker.model_dump(mode="json", exclude_none=True)
    assert scenario_base["broker"]["port"] == 0


def test_an_explicit_config_wins_over_kvrelay_config(
    repo_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scenario_base: dict[str, Any]
) -> None:
    monkeypatch.setenv("KVRELAY_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(_Started):
        _bench(tmp_path, "--config", str(repo_root / "tests/configs/test-fast.yaml"))
    assert scenario_base["broker"]["port"] == 0


@pytest.mark.parametrize(
    ("setup", "extra", "message"),
    [
        ("env-missing", [], "config file not found: {tmp}/missing.yaml"),
        ("bad-yaml", ["--config", "{tmp}/bad.yaml"], "invalid YAML in {tmp}/bad.yaml"),
        ("none", ["--preset", "huge"], "unknown model preset 'huge'"),
        ("none", ["--dataset", "{tmp}/nope.jsonl"], "file not found: {tmp}/nope.jsonl"),
        ("bad-dataset", ["--dataset", "{tmp}/bad.jsonl"], "dataset {tmp}/bad.jsonl line 2: not JSON"),
        # An output folder that cannot be made (under a file) was "file not found: ...", as if an input.
        ("bad-dataset", ["--output", "{tmp}/bad.jsonl/out"],
         "--output {tmp}/bad.jsonl/out: cannot create the folder: Not a directory"),
        # Each node's config is checked before any starts (these were tracebacks mid-run).
        ("fast", ["--impls", "mooncake,cuda_ipc"], "--impls cuda_ipc: invalid config bench-cuda_ipc: stages[0].devices"),
        ("fast", ["--impls", "vllm"], "--impls vllm: impl vllm needs --ar-model DIR"),
        # Was "unknown implementation(s) ['mooncak']; known: ['grpc', ...]", with no hint.
        ("none", ["--impls", "mooncak"], "kvrelay bench: --impls: unknown implementation 'mooncak' (did you mean "
         "'mooncake'?); known: grpc, mooncake, cuda_ipc, colocated, vllm, dit-tp1"),
        ("none", ["--impls", "grpc,Colocated,nope"],
         "unknown implementations 'Colocated' (did you mean 'colocated'?), 'nope'; known: grpc, mooncake"),
        # These ran: an empty table; two nodes, the first never stopped.
        ("fast", ["--impls", ","], "kvrelay bench: --impls ',': names no implementation; known: grpc, mooncake"),
        ("fast", ["--impls", "grpc,mooncake,grpc"], "--impls grpc,mooncake,grpc: names 'grpc' more than once"),
    ],
)
def test_bad_bench_input_is_one_line_and_exit_2(
    setup: str,
    extra: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    scenario_base: dict[str, Any],
) -> None:
    monkeypatch.delenv("KVRELAY_CONFIG", raising=False)
    if setup == "env-missing":
        monkeypatch.setenv("KVRELAY_CONFIG", str(tmp_path / "missing.yaml"))
    if setup == "fast":  # a CPU config
        monkeypatch.setenv("KVRELAY_CONFIG", str(Path(__file__).resolve().parents[1] / "configs/test-fast.yaml"))
    (tmp_path / "bad.yaml").write_text("broker: [unclosed\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a fox"}\n{not json\n')
    assert _bench(tmp_path, *[e.format(tmp=tmp_path) for e in extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrelay bench: ") and err.count("\n") == 1, err
    assert message.format(tmp=tmp_path) in err
    assert "Traceback" not in err
