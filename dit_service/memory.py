"""Page memory of one DiT replica: one host pool per rank, shared between the service and its rank.

Owns the sizing (`num_pages = kv_cache_memory_bytes // page_bytes` of the rank's HND PageLayout),
the allocation and the lifetime of the host pools. Each pool is a file in /dev/shm mapped by the
service process (which applies PutKv chunks of the gRPC fallback into it) and by its rank worker
(which registers it with its transport, verifies checksums over it and reads the prefix from it).
When the model runs on a GPU the host pool is the pinned mirror of DESIGN.md section 3: writes
land there at identical offsets and the rank copies a ticket's pages to its device pool on load.

Pools live for the whole process: they are created before registration and unlinked only after
every worker (and so every transport registration of them) is gone. This module must never free a
pool while a worker may still read it or a remote writer may still write into it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.models.presets import ModelPreset
from kvrelay.transfer.layout import KvGeometry, PageLayout

_SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def dit_geometry(preset: ModelPreset, page_size: int, dtype: str | None = None) -> KvGeometry:
    """The replica's KV geometry: the preset's, with the stage's page_size (and dtype override)."""
    geometry = preset.kv_geometry(page_size)
    if dtype is not None and dtype != geometry.dtype:
        geometry = KvGeometry(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, dtype, page_size)  # type: ignore[arg-type]
    return geometry


def rank_layouts(geometry: KvGeometry, head_shards: int, cfg_parallel: int = 1) -> list[PageLayout]:
    """Rank r holds head shard r % head_shards of head_shards (tp * sp); with CFG-parallel the
    replica has cfg_parallel groups of head_shards ranks, each group one page-id space of its own
    (rank g * head_shards + s holds shard s of group g's rows). See DitParallel's rank mapping
    (kvrelay/models/dit.py)."""
    return [
        PageLayout(geometry, num_shards=head_shards, shard=r % head_shards)
        for r in range(cfg_parallel * head_shards)
    ]


def num_pages_for(kv_cache_memory_bytes: int, layout: PageLayout) -> int:
    """Pages per rank from the per-worker memory budget; every rank of a replica has the same count
    because every head shard has the same page size."""
    pages = kv_cache_memory_bytes // layout.page_bytes
    if pages < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={kv_cache_memory_bytes} is smaller than one page "
            f"({layout.page_bytes} bytes per rank for {layout.geometry}); raise it"
        )
    return pages


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """Where one rank's host pool lives; picklable, handed to the rank worker."""

    rank: int
    path: str
    num_bytes: int


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def remove_stale_pools(replica_id: str, *, alive: Any = _pid_alive) -> list[Path]:
    """Unlink the pool files of earlier incarnations of `replica_id` whose process is gone.

    A DiT killed with SIGKILL (or any death that skips `close()`) left its pools in /dev/shm, and
    tmpfs keeps every page its ranks ever wrote (up to kv_cache_memory_bytes per rank, each time)
    until the host reboots. Called with the replica lock held, so no other process of this
    replica runs. Unlinking never frees memory still mapped: a rank that outlived its service
    keeps its mapping until it exits; only a file whose creator (the pid in its name) is dead goes.
    """
    pattern = re.compile(rf"kvrelay-{re.escape(replica_id)}-(\d+)-(?:control-)?rank\d+-[0-9a-f]{{8}}")
    removed: list[Path] = []
    for path in _SHM_DIR.glob(f"kvrelay-{replica_id}-*"):
        match = pattern.fullmatch(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            if pid == os.getpid() or alive(pid) or path.stat().st_uid != os.getuid():
                continue
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


class HostPool:
    """One rank's host pool: a shared mapping of a /dev/shm file, zero-filled on creation."""

    def __init__(self, spec: PoolSpec, *, create: bool) -> None:
        self.spec = spec
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(spec.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, spec.num_bytes)
            elif os.fstat(fd).st_size < spec.num_bytes:
                raise ValueError(f"pool file {spec.path} is smaller than {spec.num_bytes} bytes")
            self._mmap: mmap.mmap | None = mmap.mmap(fd, spec.num_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if create:
                # Nothing maps it: a pool that could not be mapped (ENOMEM for a kv_cache_memory_bytes
                # larger than the host) left its file in /dev/shm for good.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(spec.path)
            raise
        finally:
            # The mapping keeps the memory; the descriptor is not needed (and must not leak into workers).
            os.close(fd)
        self._owner = create

    @classmethod
    def create(cls, rank: int, num_bytes: int, tag: str) -> HostPool:
        path = _SHM_DIR / f"kvrelay-{tag}-rank{rank}-{uuid.uuid4().hex[:8]}"
        return cls(PoolSpec(rank, str(path), num_bytes), create=True)

    @classmethod
    def attach(cls, spec: PoolSpec) -> HostPool:
        return cls(spec, create=False)

    @property
    def buffer(self) -> mmap.mmap:
        if self._mmap is None:
            raise RuntimeError(f"pool of rank {self.spec.rank} is closed")
        return self._mmap

    def numpy(self) -> Any:
        """A writable uint8 numpy view (no copy): what PutKv and the transports use."""
        import numpy as np

        return np.frombuffer(self.buffer, dtype=np.uint8)

    def tensor(self) -> Any:
        """A writable uint8 torch view (no copy): what read_prefix and Mooncake registration use."""
        import torch

        return torch.frombuffer(self.buffer, dtype=torch.uint8)

    def close(self) -> None:
        """Unmap (and, for the creator, unlink). Callers guarantee no view of the pool is alive in
        a transport registration or a worker any more."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A numpy/torch view still exports the buffer; the mapping goes with the process.
                pass
            self._mmap = None
        if self._owner:
            try:
                os.unlink(self.spec.path)
            except FileNotFoundError:
                pass
            self._owner = False


class ReplicaMemory:
    """The host pools of every rank of a replica, owned by the service process."""

    def __init__(
        self, geometry: KvGeometry, head_shards: int, kv_cache_memory_bytes: int, tag: str, cfg_parallel: int = 1
    ) -> None:
        self.geometry = geometry
        self.layouts = rank_layouts(geometry, head_shards, cfg_parallel)
        self.num_pages = num_pages_for(kv_cache_memory_bytes, self.layouts[0])
        self.pools: list[HostPool] = []
        try:
            for rank, layout in enumerate(self.layouts):
                self.pools.append(HostPool.create(rank, layout.pool_bytes(self.num_pages), tag))
        except BaseException:
            self.close()
            raise
        self._arrays = [pool.numpy() for pool in self.pools]

    @property
    def world_size(self) -> int:
        return len(self.layouts)

    @property
    def page_bytes(self) -> int:
        return self.layouts[0].page_bytes

    def specs(self) -> list[PoolSpec]:
        return [pool.spec for pool in self.pools]

    def region(self, rank: int) -> Any:
        """Rank `rank`'s pool as a writable uint8 numpy array (the PutKv destination)."""
        return self._arrays[rank]

    def page_ranges(self, page_ids: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
        """Byte ranges [start, stop) of `page_ids` in any rank's pool, adjacent pages merged."""
        ranges: list[tuple[int, int]] = []
        for page in sorted(set(int(p) for p in page_ids)):
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page id {page} out of range for a pool of {self.num_pages} pages")
            start, stop = page * self.page_bytes, (page + 1) * self.page_bytes
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], stop)
            else:
                ranges.append((start, stop))
        return ranges

    def close(self) -> None:
        """Free every pool. Only after the workers have stopped: their transport registrations
        (and any remote writer aimed at them) must be gone first (DESIGN.md section 6, fail stop)."""
        self._arrays = []
        for pool in self.pools:
            pool.close()
        self.pools = []
