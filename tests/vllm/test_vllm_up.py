"""`kvrelay up` with `model: {engine: vllm}` on the AR stage: the broker, a vLLM AR (a tiny random
Llama built at test time, KvRelayConnector writing over Mooncake TCP) and the built-in `small` DiT
produce images end to end; every DiT page is free afterwards. One node (one vLLM start) for the
module."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from PIL import Image

pytest.importorskip("vllm", reason="engine: vllm needs vLLM (scripts/setup.sh --vllm)")

from kvrelay.ar_service.vllm_engine import PREFILL_FAULT_ENV, VllmTokenizer  # noqa: E402
from kvrelay.client import KvRelayClient, KvRelayError  # noqa: E402
from tests.vllm.checkpoint import build_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

# A prompt containing this text makes the vLLM engine's prefill raise mid-pass (the fault hook).
FAULT_MARKER = "@@fault@@"


def vllm_node_config(tmp_path: Path, checkpoint: Path) -> Path:
    data = yaml.safe_load((REPO / "tests" / "configs" / "test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    ar, dit = data["stages"]
    # No model.dtype, as in docs/ar.md: vLLM gets float32 on the CPU like the DiT (its own `auto`
    # picked bfloat16 on CPUs with bf16, and the broker refused the AR's registration).
    ar["model"] = {"engine": "vllm", "path": str(checkpoint), "vllm_args": {"max_model_len": 1024}}
    ar["request_timeout_seconds"] = 120
    # Several tickets per prefill: the vLLM handler answers PrefillTickets.
    ar["max_num_seqs"] = 4
    # The DiT whose geometry is the checkpoint's (4 layers, 4 kv heads, head_dim 32, fp32).
    dit["model"] = {"preset": "small"}
    dit["request_timeout_seconds"] = 120
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(data))
    return config


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, int]]:
    tmp_path = tmp_path_factory.mktemp("vllm-node")
    checkpoint = build_checkpoint(tmp_path / "llama", seed=5)
    config = vllm_node_config(tmp_path, checkpoint)
    # --metrics-port 0: the node's default 9399 is a real node's (a quickstart beside this test failed on it).
    argv = [sys.executable, "-m", "kvrelay", "up", "--config", str(config), "--log-dir", str(tmp_path / "logs"),
            "--metrics-port", "0"]  # fmt: skip
    marker = VllmTokenizer(str(checkpoint)).encode(FAULT_MARKER)[1:]  # without BOS
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PREFILL_FAULT_ENV: ",".join(map(str, marker))}
    up = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert up.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("try: kvrelay generate"):
                break
        text = "".join(lines)
        match = re.search(r"--target (\S+)", text)
        assert match, f"kvrelay up did not come up:\n{text}\n{up.stderr.read() if up.poll() is not None else ''}"
        yield match.group(1), tmp_path / "logs", up.pid
        up.send_signal(signal.SIGTERM)
        assert up.wait(90) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_generates_images_and_frees_every_page(node: tuple[str, Path, int]) -> None:
    with KvRelayClient(node[0]) as client:
        # Two CFG rows (guidance 2.0), then one (guidance 1.0).
        first = client.generate("a red fox in the snow", seed=11, width=64, height=64, timeout=180).result()
        assert Image.open(io.BytesIO(first.png)).size == (64, 64)
        single = client.generate(
            "a lighthouse at night", seed=3, width=64, height=64, guidance_scale=1.0, timeout=180
        ).result()
        assert Image.open(io.BytesIO(single.png)).size == (64, 64)
        again = client.generate("a red fox in the snow", seed=11, width=64, height=64, timeout=180).result()
        assert again.png == first.png  # same prompt and seed, same bits
        assert {r.replica_id for r in client.list_replicas() if r.up} == {"ar-0", "dit-0"}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pools = client.get_pools()
            if all(p.free_pages == p.total_pages for p in pools):
                break
            time.sleep(0.2)
        assert all(p.free_pages == p.total_pages for p in pools), pools


def test_the_vllm_ar_service_loads_no_torch_and_its_engine_does(node: tuple[str, Path, int]) -> None:
    """Once SERVING, the `kvrelay ar` process of an `engine: vllm` stage has no libtorch mapped (its
    tokenizer runs vLLM's pipeline with `tokenizers`: kvrelay.ar_service.vllm_tokenizer), and its
    vLLM engine process has. Before, the service loaded transformers' AutoTokenizer, and torch with it."""
    import psutil

    (ar,) = [c for c in psutil.Process(node[2]).children() if c.cmdline()[3:4] == ["ar"]]
    assert "libtorch" not in Path(f"/proc/{ar.pid}/maps").read_text(), "the vLLM AR service process imported torch"
    engines = ar.children()
    assert any("libtorch" in Path(f"/proc/{e.pid}/maps").read_text() for e in engines), engines
    # The service tokenized every request above with it, and said so at start.
    lines = [json.loads(line) for line in (node[1] / "ar-0.log").read_text().splitlines() if line.startswith("{")]
    (chosen,) = [line for line in lines if line.get("event") == "vllm_tokenizer_in_service"]
    assert chosen["backend"] == "tokenizers", chosen


def _prefill_batches(log_dir: Path) -> list[dict[str, object]]:
    lines = [line for f in log_dir.glob("*.log") for line in f.read_text().splitlines()]
    events = [json.loads(line) for line in lines if '"prefill_batch"' in line and line.startswith("{")]
    return [e for e in events if e.get("event") == "prefill_batch"]


def test_concurrent_requests_share_a_vllm_prefill(node: tuple[str, Path, int]) -> None:
    target, log_dir, _ = node
    with KvRelayClient(target) as client:
        # Tickets that reach the AR while it serves one wait and go together in the next batch.
        for _ in range(3):
            handles = [client.generate(f"a boat number {i}", seed=i, width=64, height=64, timeout=180) for i in range(6)]
            results = [h.result() for h in handles]
            assert all(Image.open(io.BytesIO(r.png)).size == (64, 64) for r in results)
            batches = _prefill_batches(log_dir)
            if any(int(str(b["prefilled"])) > 1 for b in batches):
                break
        assert any(int(str(b["prefilled"])) > 1 for b in batches), "no shared prefill in 3 rounds"


def _wait_all_pages_free(client: KvRelayClient) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pools = client.get_pools()
        if all(p.free_pages == p.total_pages for p in pools):
            break
        time.sleep(0.2)
    assert all(p.free_pages == p.total_pages for p in pools), pools


def test_a_fault_mid_shared_prefill_fails_only_its_request(node: tuple[str, Path, int]) -> None:
    target, log_dir, _ = node
    with KvRelayClient(target) as client:
        for _ in range(3):
            # Tickets that queue behind the first share the next prefill, the faulty one among them.
            handles = [
                client.generate(f"a kite number {i}", seed=i, width=64, height=64, timeout=180)
                for i in range(6)
            ]
            faulty = client.generate(f"a kite {FAULT_MARKER}", seed=9, width=64, height=64, timeout=180)
            handles += [
                client.generate(f"a kite number {i}", seed=i, width=64, height=64, timeout=180)
                for i in range(6, 9)
            ]
            # The batch-mates succeed; the faulty request fails with its reason.
            assert all(Image.open(io.BytesIO(h.result().png)).size == (64, 64) for h in handles)
            with pytest.raises(KvRelayError) as failed:
                faulty.result()
            assert failed.value.reason == "PREFILL_FAILED" and "InjectedPrefillFault" in str(failed.value)
            # A shared prefill that carried the faulty ticket ran every other ticket of it alone.
            shared = [b for b in _prefill_batches(log_dir) if int(str(b["tickets"])) > 1]
            if any(int(str(b["prefilled"])) == int(str(b["tickets"])) - 1 for b in shared):
                break
        else:
            pytest.fail("the faulty ticket never shared a prefill in 3 rounds")
        # Nothing leaks: every ticket released, every DiT page free; the AR keeps serving.
        assert client.list_tickets() == []
        _wait_all_pages_free(client)
        after = client.generate("a kite after the fault", seed=1, width=64, height=64, timeout=180).result()
        assert Image.open(io.BytesIO(after.png)).size == (64, 64)
        _wait_all_pages_free(client)
