"""A DiT's page pools in /dev/shm as a new user met them, black-box: `kill -9` of a DiT under
`kvrelay up` left its pool files there for good (tmpfs holds every page its ranks wrote until a
reboot), and a kv_cache_memory_bytes larger than the host left a 1 PB sparse file and a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvrelay.dit_service import memory
from kvrelay.dit_service.memory import HostPool, PoolSpec, remove_stale_pools

REPO = Path(__file__).resolve().parents[2]
# A replica id no test or node uses, so that the sweep below can only meet this test's files.
REPLICA = f"dit-9{os.getpid() % 1000}"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _pool_file(pid: int, control: bool = False) -> Path:
    name = f"kvrelay-{REPLICA}-{pid}-{'control-' if control else ''}rank0-{uuid.uuid4().hex[:8]}"
    path = memory._SHM_DIR / name
    path.write_bytes(b"\0" * 64)
    return path


def test_pools_of_a_dead_incarnation_are_removed_and_no_others() -> None:
    dead = _dead_pid()
    gone = [_pool_file(dead), _pool_file(dead, control=True)]
    kept = [
        _pool_file(os.getpid()),  # this process's own
        _pool_file(os.getppid()),  # a live process's
        memory._SHM_DIR / f"kvrelay-{REPLICA}0-{dead}-rank0-{uuid.uuid4().hex[:8]}",  # another replica (dit-9NN0)
        memory._SHM_DIR / f"kvrelay-{REPLICA}-{dead}-notes",  # not a pool's name
    ]
    for path in kept[2:]:
        path.write_bytes(b"")
    try:
        removed = remove_stale_pools(REPLICA)
        assert sorted(removed) == sorted(gone)
        assert [p.exists() for p in gone] == [False, False]
        assert all(p.exists() for p in kept)
        assert remove_stale_pools(REPLICA) == []  # idempotent
    finally:
        for path in gone + kept:
            path.unlink(missing_ok=True)


def test_a_pool_that_cannot_be_mapped_leaves_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(memory.mmap, "mmap", no_memory)
    path = memory._SHM_DIR / f"kvrelay-{REPLICA}-{os.getpid()}-rank0-{uuid.uuid4().hex[:8]}"
    try:
        with pytest.raises(OSError, match="Cannot allocate memory"):
            HostPool(PoolSpec(0, str(path), 1 << 20), create=True)
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)  # what the code under test leaves, when it fails


@pytest.mark.slow
def test_page_memory_the_host_cannot_map_is_one_line_exit_2(tmp_path: Path) -> None:
    text = (REPO / "tests/configs/test-fast.yaml").read_text()
    assert "kv_cache_memory_bytes: 8388608" in text
    config = tmp_path / "huge.yaml"
    config.write_text(text.replace("kv_cache_memory_bytes: 8388608", "kv_cache_memory_bytes: 1000000000000000000"))
    env = {**os.environ, "KVRELAY_LOG_FORMAT": "console", "KVRELAY_NATIVE_CAPTURE": "0",
           "KVRELAY_LOCK_DIR": str(tmp_path / "locks")}  # fmt: skip
    env.pop("KVRELAY_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrelay", "dit", "--config", str(config), "--broker", "127.0.0.1:9"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Before: exit 3 (restarted by `kvrelay up` again and again), `startup failed: [Errno 12] Cannot
    # allocate memory` after a logged traceback, and the 1 EB sparse pool file left in /dev/shm.
    assert proc.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("kvrelay dit: ")]
    assert lines == [
        "kvrelay dit: stages[1].kv_cache_memory_bytes: cannot map 1000000000000000000 bytes of page memory per rank "
        "(Cannot allocate memory): lower it, or give the host (a container: shm_size) more memory"
    ]
    assert list(memory._SHM_DIR.glob(f"kvrelay-dit-0-{proc.pid}-*")) == []
