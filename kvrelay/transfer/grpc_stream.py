"""The gRPC-stream fallback transport (no `kv_transfer_config`, DESIGN.md section 5).

Sender: streams each write's bytes to `DitService.PutKv` at the destination endpoint in chunks
of at most 1 MiB; one client stream per endpoint carries every write bound there (each chunk
names its write). gRPC's stream flow control paces the sender: the request iterator is pulled
only as fast as the receiver drains its window, so staging is never copied whole.
Receiver: `apply_put_kv` copies one chunk into a rank's region with bounds checks; the DiT
servicer calls it for each message. Same tickets, same pages, same bits as Mooncake.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvrelay.security import AUTHORIZATION_METADATA, ChannelSecurity, make_sync_channel
from kvrelay.server_tls import CertificateFiles
from kvrelay.transfer.checksum import as_memoryview, write_checksum
from kvrelay.transfer.planner import PlannedWrite
from kvrelay.transfer.transport import (
    GRPC_MAX_CHUNK_BYTES,
    FinishedCall,
    RegionDescriptor,
    WriteOutcome,
    check_writes_fit,
)
from kvrelay.v1 import dit_pb2, dit_pb2_grpc

# Room for a 1 MiB chunk plus its envelope on both ends of the channel.
_CHANNEL_MAX_BYTES = 4 * GRPC_MAX_CHUNK_BYTES


class PutKvRejected(ValueError):
    """A PutKv chunk that must not be applied (outside the region, or too large)."""


# ---------------------------------------------------------------------------------------------
# Receiving side
# ---------------------------------------------------------------------------------------------


def apply_put_kv(
    region: Any,
    request: dit_pb2.PutKvRequest,
    region_length: int,
    allowed_ranges: Sequence[tuple[int, int]] | None = None,
) -> int:
    """Copy one PutKv chunk into `region` (writable bytes-like, numpy array or uint8 tensor).

    Raises PutKvRejected, before touching memory, for a chunk over 1 MiB, one that reaches
    outside [0, region_length), or (when `allowed_ranges` [start, stop) are given, e.g. the
    segments the ticket's plan expects) one outside every allowed range. Returns bytes copied.
    """
    data = request.data
    n = len(data)
    start = request.dst_offset
    if n > GRPC_MAX_CHUNK_BYTES:
        raise PutKvRejected(f"PutKv chunk of {n} bytes exceeds the {GRPC_MAX_CHUNK_BYTES}-byte limit")
    if start + n > region_length:
        raise PutKvRejected(
            f"PutKv chunk [{start}, {start + n}) for ticket {request.ticket_id} row {request.row} "
            f"lies outside the {region_length}-byte region of rank {request.dst_rank}"
        )
    if allowed_ranges is not None and not any(lo <= start and start + n <= hi for lo, hi in allowed_ranges):
        raise PutKvRejected(
            f"PutKv chunk [{start}, {start + n}) for ticket {request.ticket_id} row {request.row} "
            f"is outside the pages reserved for it on rank {request.dst_rank}"
        )
    if n == 0:
        return 0
    if hasattr(region, "data_ptr") and region.device.type != "cpu":
        import torch

        region[start : start + n].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return n
    view = as_memoryview(region)
    if view.readonly:
        raise PutKvRejected("PutKv region is read-only")
    if region_length > len(view):
        raise PutKvRejected(f"region_length {region_length} exceeds the {len(view)}-byte region memory")
    view[start : start + n] = data
    return n


@dataclass(slots=True)
class PutKvSink:
    """Applies the chunks of one PutKv stream to the regions of the ranks it names and counts them.

    `regions` maps dst_rank -> (memory, length). The DiT servicer builds one per stream."""

    regions: Mapping[int, tuple[Any, int]]
    bytes_received: int = 0
    chunks_received: int = 0
    by_write: dict[tuple[str, int, int, int], int] = field(default_factory=dict)

    def apply(self, request: dit_pb2.PutKvRequest, allowed_ranges: Sequence[tuple[int, int]] | None = None) -> None:
        try:
            memory, length = self.regions[request.dst_rank]
        except KeyError:
            raise PutKvRejected(f"PutKv names dst_rank {request.dst_rank}, which this process does not hold") from None
        n = apply_put_kv(memory, request, length, allowed_ranges)
        self.bytes_received += n
        self.chunks_received += 1
        key = (request.ticket_id, request.row, request.src_rank, request.dst_rank)
        self.by_write[key] = self.by_write.get(key, 0) + n

    def response(self) -> dit_pb2.PutKvResponse:
        return dit_pb2.PutKvResponse(bytes_received=self.bytes_received, chunks_received=self.chunks_received)


class GrpcStreamReceiver:
    """Describes this process's rank regions for the fallback: senders address them by offset
    through the DiT service at `endpoint`, so nothing is registered with a transport engine."""

    name = "grpc"

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.regions: dict[int, tuple[Any, int]] = {}

    def register_region(self, memory: Any, rank: int) -> RegionDescriptor:
        # A torch tensor on a device has no host view; numpy arrays (whose `.device` is the
        # string "cpu" in numpy 2) and CPU tensors are measured through a byte view.
        on_device = hasattr(memory, "data_ptr") and getattr(memory.device, "type", "cpu") != "cpu"
        length = int(memory.numel() * memory.element_size()) if on_device else len(as_memoryview(memory))
        self.regions[rank] = (memory, length)
        return RegionDescriptor(rank=rank, transport="grpc", endpoint=self.endpoint, base_address=0, length=length)

    def sink(self) -> PutKvSink:
        return PutKvSink(self.regions)

    def close(self) -> None:
        self.regions.clear()


# ---------------------------------------------------------------------------------------------
# Sending side
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _StreamProgress:
    started: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)


class GrpcStreamSender:
    """KvSender over DitService.PutKv. Channels are cached per endpoint until `close`, until a
    call on one ends UNAVAILABLE, or until `tls_files` took a replaced certificate (`_forget`):
    a new channel presents the client certificate the files hold then (kvrelay.server_tls)."""

    name = "grpc"

    def __init__(
        self,
        max_chunk_bytes: int = GRPC_MAX_CHUNK_BYTES,
        security: ChannelSecurity | None = None,
        tls_files: CertificateFiles | None = None,
    ) -> None:
        if not 0 < max_chunk_bytes <= GRPC_MAX_CHUNK_BYTES:
            raise ValueError(f"max_chunk_bytes must be in (0, {GRPC_MAX_CHUNK_BYTES}], got {max_chunk_bytes}")
        self.max_chunk_bytes = max_chunk_bytes
        self.security = security
        self.tls_files = tls_files
        self._channels: dict[str, grpc.Channel] = {}
        # The tls_files generation each cached channel was dialled with.
        self._channel_generation: dict[str, int] = {}
        # Calls running on each channel (by id), so a forgotten one closes only once idle.
        self._calls: dict[int, int] = {}
        self._forgotten: dict[int, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="putkv-stream")
        # Stream calls whose wait ended before they returned: (ticket, in-doubt writes, futures,
        # bytes each endpoint must acknowledge), until collect_finished() sees them return.
        self._in_doubt: list[
            tuple[str, list[tuple[int, PlannedWrite, str, int]], dict[str, Future[Any]], dict[str, int]]
        ] = []

    def _acquire(self, endpoint: str) -> grpc.Channel:
        security, generation = self.security, 0
        if self.tls_files is not None and security is not None:
            security = dataclasses.replace(security, tls=self.tls_files.current())
            generation = self.tls_files.generation
        idle: grpc.Channel | None = None
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is not None and self._channel_generation.get(endpoint, 0) != generation:
                # Dialled with the certificate replaced since: closed now if idle, else once its
                # calls returned (they run on, on their connection).
                del self._channels[endpoint]
                if id(channel) in self._calls:
                    self._forgotten[id(channel)] = channel
                else:
                    idle = channel
                channel = None
            if channel is None:
                # A local subchannel pool: channels to one target otherwise share gRPC's global
                # subchannel, and a fresh channel would inherit a failed one's reconnect backoff.
                channel = make_sync_channel(
                    endpoint, security, max_request_bytes=_CHANNEL_MAX_BYTES,
                    options=[("grpc.use_local_subchannel_pool", 1)],
                )
                self._channels[endpoint] = channel
                self._channel_generation[endpoint] = generation
            self._calls[id(channel)] = self._calls.get(id(channel), 0) + 1
        if idle is not None:
            idle.close()
        return channel

    def _release(self, channel: grpc.Channel) -> None:
        with self._lock:
            left = self._calls[id(channel)] - 1
            if left:
                self._calls[id(channel)] = left
                return
            del self._calls[id(channel)]
            forgotten = self._forgotten.pop(id(channel), None)
        if forgotten is not None:
            forgotten.close()

    def _forget(self, endpoint: str, channel: grpc.Channel) -> None:
        """Drop the channel a call to `endpoint` just failed on (UNAVAILABLE); the next write
        dials afresh. A channel whose connection failed waits out gRPC's reconnect backoff
        (growing to 2 minutes) and fails every call at once meanwhile: found across network
        namespaces, where writes to a DiT kept failing `failed to connect to all addresses`
        after the AR -> DiT link was back. It closes once its last call returns."""
        with self._lock:
            if self._channels.get(endpoint) is channel:
                del self._channels[endpoint]
                self._forgotten[id(channel)] = channel

    def _chunks(
        self, view: memoryview, ticket_id: str, items: list[tuple[int, PlannedWrite]], prog: _StreamProgress
    ) -> Iterator[dit_pb2.PutKvRequest]:
        for i, w in items:
            prog.started.add(i)
            for seg in w.segments:
                for off in range(0, seg.length, self.max_chunk_bytes):
                    n = min(self.max_chunk_bytes, seg.length - off)
                    src = seg.src_offset + off
                    yield dit_pb2.PutKvRequest(
                        ticket_id=ticket_id, row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank,
                        dst_offset=seg.dst_offset + off, data=bytes(view[src : src + n]),
                    )
            prog.finished.add(i)

    def _send_stream(
        self, endpoint: str, view: memoryview, ticket_id: str, items: list[tuple[int, PlannedWrite]],
        prog: _StreamProgress, timeout_s: float, write_token: str = "",
    ) -> dit_pb2.PutKvResponse:
        channel = self._acquire(endpoint)
        metadata = ((AUTHORIZATION_METADATA, f"Bearer {write_token}"),) if write_token else None
        try:
            # Deadline on the call itself: on expiry gRPC cancels the stream at both ends.
            response: dit_pb2.PutKvResponse = dit_pb2_grpc.DitServiceStub(channel).PutKv(
                self._chunks(view, ticket_id, items, prog), timeout=timeout_s, wait_for_ready=False,
                metadata=metadata,
            )
        except grpc.RpcError as err:
            if isinstance(err, grpc.Call) and err.code() is grpc.StatusCode.UNAVAILABLE:
                self._forget(endpoint, channel)
            raise
        finally:
            self._release(channel)
        return response

    def write(
        self,
        staging: Any,
        writes: Sequence[PlannedWrite],
        destinations: Mapping[int, RegionDescriptor],
        ticket_id: str,
        timeout_s: float,
        *,
        write_token: str = "",
    ) -> list[WriteOutcome]:
        """Stream `writes` to their endpoints; one outcome per write, in order. A write is OK only
        when its endpoint acknowledged every byte of its stream. `write_token` (bound replica
        tokens) is the bearer of these calls: the channel itself carries only the replica id."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        view = as_memoryview(staging)
        check_writes_fit(writes, destinations, len(view))
        for w in writes:
            if destinations[w.dst_rank].transport != "grpc":
                raise ValueError(f"destination rank {w.dst_rank} is not a grpc region")
        by_endpoint: dict[str, list[tuple[int, PlannedWrite]]] = {}
        for i, w in enumerate(writes):
            by_endpoint.setdefault(destinations[w.dst_rank].endpoint, []).append((i, w))
        progress = {ep: _StreamProgress() for ep in by_endpoint}
        futures = {
            ep: self._executor.submit(
                self._send_stream, ep, view, ticket_id, items, progress[ep], timeout_s, write_token
            )
            for ep, items in by_endpoint.items()
        }
        # Hash while the streams send: the staging bytes do not change during a write.
        checksums = [write_checksum(view, w) for w in writes]
        failures: dict[str, str] = {}
        doubtful: dict[str, str] = {}
        for ep, fut in futures.items():
            expected = sum(w.num_bytes for _, w in by_endpoint[ep])
            try:
                # The call carries its own deadline; the margin only covers thread scheduling.
                resp = fut.result(timeout=timeout_s + 5.0)
            except grpc.RpcError as e:
                failures[ep] = f"PutKv to {ep} failed: {e.code().name}: {e.details()}"
                continue
            except FutureTimeout:
                # The stream call has not returned: its chunks may still be applied. In doubt.
                doubtful[ep] = f"PutKv to {ep} did not return within {timeout_s:.1f}s; it may still land"
                continue
            except Exception as exc:  # noqa: BLE001 - the call returned (by raising): final
                # Escaping would leave the other endpoints' streams unaccounted for (and a
                # ValueError would read as "refused before sending" to the caller).
                failures[ep] = f"PutKv to {ep} raised {exc!r}"
                continue
            if resp.bytes_received != expected:
                failures[ep] = f"PutKv to {ep} acknowledged {resp.bytes_received} of {expected} bytes"

        outcomes: list[WriteOutcome] = []
        in_doubt: list[tuple[int, PlannedWrite, str, int]] = []
        for i, w in enumerate(writes):
            ep = destinations[w.dst_rank].endpoint
            prog = progress[ep]
            failure = failures.get(ep)
            if ep in doubtful and i in prog.started:
                outcomes.append(
                    WriteOutcome(w.row, w.src_rank, w.dst_rank, "IN_DOUBT", w.num_bytes, checksums[i], doubtful[ep])
                )
                in_doubt.append((i, w, ep, checksums[i]))
            elif ep in doubtful:
                outcomes.append(WriteOutcome(w.row, w.src_rank, w.dst_rank, "NOT_STARTED", 0, 0, doubtful[ep]))
            elif failure is None:
                outcomes.append(WriteOutcome(w.row, w.src_rank, w.dst_rank, "OK", w.num_bytes, checksums[i]))
            elif i not in prog.started:
                outcomes.append(WriteOutcome(w.row, w.src_rank, w.dst_rank, "NOT_STARTED", 0, 0, failure))
            else:
                outcomes.append(
                    WriteOutcome(w.row, w.src_rank, w.dst_rank, "FAILED", w.num_bytes, checksums[i], failure)
                )
        if in_doubt:
            acked = {ep: sum(w.num_bytes for _, w in by_endpoint[ep]) for ep in doubtful}
            with self._lock:
                self._in_doubt.append((ticket_id, in_doubt, {ep: futures[ep] for ep in doubtful}, acked))
        return outcomes

    def collect_finished(self) -> list[FinishedCall]:
        """Stream calls that had in-doubt writes and have returned since, with final outcomes."""
        with self._lock:
            calls, self._in_doubt = self._in_doubt, []
            pending = [c for c in calls if not all(f.done() for f in c[2].values())]
            self._in_doubt = pending
        finished = []
        for ticket_id, writes, futs, expected in (c for c in calls if c not in pending):
            outcomes = []
            for _, w, ep, checksum in writes:
                fut = futs[ep]
                exc = fut.exception()
                if exc is None and fut.result().bytes_received == expected[ep]:
                    outcomes.append(WriteOutcome(w.row, w.src_rank, w.dst_rank, "OK", w.num_bytes, checksum))
                else:
                    why = f"PutKv to {ep} returned late: {exc!r}" if exc else f"PutKv to {ep} returned short"
                    outcomes.append(WriteOutcome(w.row, w.src_rank, w.dst_rank, "FAILED", w.num_bytes, checksum, why))
            finished.append(FinishedCall(ticket_id, tuple(outcomes)))
        return finished

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        with self._lock:
            for channel in [*self._channels.values(), *self._forgotten.values()]:
                channel.close()
            self._channels.clear()
            self._forgotten.clear()
            self._calls.clear()


def make_sender(
    max_chunk_bytes: int = GRPC_MAX_CHUNK_BYTES,
    security: ChannelSecurity | None = None,
    tls_files: CertificateFiles | None = None,
) -> GrpcStreamSender:
    return GrpcStreamSender(max_chunk_bytes, security, tls_files)


def make_receiver(endpoint: str) -> GrpcStreamReceiver:
    return GrpcStreamReceiver(endpoint)
