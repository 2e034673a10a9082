"""`kvrelay up` of a tiny real node as a new user runs it in a terminal (no --log-dir, console
logs): a clean start, one image and Ctrl-C leave none of gRPC core's routine lines on stderr
(absl's "All log messages before absl::InitializeLog()" and "chttp2_transport.cc ... Got goaway"
were printed at every stop), and stdout is the node's report alone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from kvrelay.client import KvRelayClient

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

NOISE = ("absl::InitializeLog", "chttp2_transport", "Got goaway")


def test_a_clean_start_and_stop_of_a_real_node_prints_no_grpc_core_noise(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_VERBOSITY", "GRPC_TRACE", "KVRELAY_CONFIG")}
    env.update(PYTHONUNBUFFERED="1", KVRELAY_LOG_FORMAT="console")  # as on a terminal
    up = subprocess.Popen(
        [sys.executable, "-m", "kvrelay", "up", "--config", str(config), "--metrics-port", "0"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    err: list[str] = []
    assert up.stderr is not None and up.stdout is not None
    reader = threading.Thread(target=lambda: err.extend(up.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        out: list[str] = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            out.append(line)
            if line.startswith("try: kvrelay generate"):
                break
        match = re.search(r"--target (\S+)", "".join(out))
        assert match, "".join(out) + "".join(err[-40:])
        # stdout is the node's report alone: the children's "listening on" lines go to stderr.
        assert out[0].startswith("kvrelay up: every process is SERVING") and len(out) == 7, out
        with KvRelayClient(match.group(1)) as client:
            client.generate("a red fox", seed=1, width=64, height=64, timeout=120).result()
        up.send_signal(signal.SIGINT)
        assert up.wait(120) == 0, "".join(err[-40:])
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)
    reader.join(10)
    noise = [line for line in err if any(text in line for text in NOISE)]
    assert noise == [], "".join(noise)
