"""A TCP proxy for tests that cut a client's connection mid-stream, as a network failure would.

`cut()` aborts every connection open now (both sides see a reset); the proxy keeps listening, so
the client's next attempt connects again. `blackhole()` drops one direction silently, as a one-way
partition does (packets lost, no reset, no FIN: the side whose packets are lost learns nothing,
its peer sees a connection that stopped answering), on open connections and new ones, until
`heal()`. Runs on the caller's asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, source_host: str | None = None) -> None:
        self._target = (target_host, target_port)
        # The address the proxy dials the target from (e.g. 127.0.0.2: another client host, as
        # the target sees it); None: the system's choice.
        self._local = None if source_host is None else (source_host, 0)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.connections = 0
        # Directions dropped: "to_target" (client -> target) and/or "to_client".
        self._dropped: set[str] = set()
        self.bytes_dropped = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def cut(self) -> int:
        """Abort every open connection; returns how many there were."""
        writers = list(self._writers)
        for writer in writers:
            writer.transport.abort()
        self._writers.clear()
        return len(writers)

    def blackhole(self, direction: str = "to_target") -> None:
        """Drop every byte (and the close) flowing in `direction` from now on."""
        if direction not in ("to_target", "to_client"):
            raise ValueError(f"direction: to_target or to_client, got {direction!r}")
        self._dropped.add(direction)

    def heal(self) -> None:
        self._dropped.clear()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target, local_addr=self._local)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        for src, dst, direction in ((reader, up_writer, "to_target"), (up_reader, writer, "to_client")):
            task = asyncio.get_running_loop().create_task(self._pipe(src, dst, direction))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str) -> None:
        try:
            while data := await src.read(65536):
                if direction in self._dropped:
                    self.bytes_dropped += len(data)
                    continue
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if direction not in self._dropped:
                # One side ended: end the other (a reset when the cut aborted it already). Not
                # across a blackhole: the close is lost with the bytes.
                self._writers.discard(dst)
                with contextlib.suppress(Exception):
                    dst.transport.abort()
