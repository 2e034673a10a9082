"""The asyncio client: `AsyncKvRelayClient` and its `AsyncGenerationHandle` (grpc.aio), a thin
face over `_core`.

Owns the asyncio I/O (awaited calls, stream reads, sleeps); every rule is `_core`'s, shared with
the blocking face, so both behave the same (deadline on every call, retries only where safe, only
`KvRelayError` escapes). A grpc.aio channel belongs to the event loop it was created on, so the
client opens its channel on first use, in the running loop: it may be constructed anywhere (module
level, sync code) and used in the loop that calls it. A task of its own closes that channel when the
loop ends (asyncio.run cancels every task first); the next loop to use it gets a fresh channel; two
live loops at once is `FAILED_PRECONDITION`/`WRONG_EVENT_LOOP`.
"""

from __future__ import annotations

import asyncio
import collections
import gc
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc._cython import cygrpc

from . import _core
from ._common import CANCEL_TIMEOUT
from .errors import KvRelayError, error_from_rpc
from .types import (
    CredentialsReload,
    Generation,
    GenerationEvent,
    GenerationPage,
    GenerationResult,
    GenerationState,
    PoolStatus,
    Replica,
    ReplicaRegistry,
    Ticket,
    TicketState,
)

_T = TypeVar("_T")


class AsyncKvRelayClient(_core.ClientBase):
    """asyncio client for a kvrelay node; the same API as :class:`KvRelayClient`, awaited.

    Example::

        import asyncio
        from kvrelay.client import AsyncKvRelayClient

        async def main() -> None:
            async with AsyncKvRelayClient("127.0.0.1:50051") as client:
                handle = await client.generate("a red fox in the snow", seed=7)
                async for event in handle.events():
                    print(event.state.name, event.step, event.total_steps)
                (await handle.result()).save("fox.png")

        asyncio.run(main())
    """

    _channel: grpc.aio.Channel | None
    _channel_at_construction = False
    # The loop the channel was opened on (None until first use), and the task that closes the
    # channel when that loop ends (asyncio.run cancels every task of its loop before closing it).
    _loop: asyncio.AbstractEventLoop | None = None
    _guard: asyncio.Task[None] | None = None

    def _open_channel(self, settings: _core.ClientSettings) -> grpc.aio.Channel:
        if settings.credentials is None:
            return grpc.aio.insecure_channel(settings.target, options=settings.options)
        return grpc.aio.secure_channel(settings.target, settings.credentials, options=settings.options)

    def _stubs_in_loop(self, request_id: str | None = None) -> dict[_core.Service, Any]:
        """The stubs of this loop's channel, opening it on first use in the running loop.

        A client made at module level or in sync code and used inside `asyncio.run(...)` failed
        with grpc's raw "attached to a different loop" RuntimeError: grpc.aio had bound its
        channel to whatever loop was current at construction. A loop that has closed since can
        never run the old channel's calls again, so the next loop gets a fresh channel; a loop
        that is still open may have calls in flight on it, and is never taken over silently.
        """
        self._check_open(request_id)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                raise _wrong_loop_error(request_id)
            self._loop = loop
            self._open_calls.clear()
            channel = self._open_channel(self._settings)
            self._attach_channel(channel)
            self._guard = loop.create_task(self._close_with_loop(channel), name="kvrelay-client-channel")
            # A loop closed without cancelling its tasks (run_until_complete, then close()) drops
            # the guard pending: nothing to report, the channel goes with the loop.
            self._guard._log_destroy_pending = False  # type: ignore[attr-defined]
        return self._stubs

    async def _close_with_loop(self, channel: grpc.aio.Channel) -> None:
        """Wait until cancelled, then close `channel` properly, in its own loop, while that loop
        still runs. asyncio.run's end cancels every task of its loop (this one too) before it
        closes the loop: a client used in one `asyncio.run(...)` and not closed there left its
        open streams to grpc, whose answers came after the loop had closed and were logged
        ("Exception in callback PollerCompletionQueue._handle_events ... RuntimeError: Event loop
        is closed") by the next loop to use grpc: the client's own, in the next asyncio.run."""
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            if self._channel is channel and not self._closed:
                await self._shut(channel)
                self._loop = None  # the next call, in whichever loop, opens a fresh channel
                # grpc's tasks that wait for its calls' answers (a stream's status, also of one
                # read to its end) were cancelled with every other task: the wait for them in
                # _shut cannot see when grpc's core answers; this does.
                await _orphaned_core_answers_settled(asyncio.get_running_loop())
            raise

    async def _shut(self, channel: grpc.aio.Channel) -> None:
        # grpc.aio's Channel.close() does not cancel a stream that no task is awaiting inside
        # grpc (ours are read between events): the generation ran on, and its handle still
        # received SUCCEEDED. Cancel them here, as the blocking client's close() does.
        for call in list(self._open_calls):
            call.cancel()
        await channel.close()
        # A cancelled call ends in grpc's core a moment later, and grpc's poller thread hands its
        # completion to this loop then: a loop closed before that (asyncio.run's end, just after
        # close()) made grpc log "Exception in callback PollerCompletionQueue._handle_events ...
        # RuntimeError: Event loop is closed" from whatever other loop took the completion (a
        # server's, another thread's). Wait here until the core has answered each ended call.
        await _cancelled_calls_settled()

    async def close(self) -> None:
        """Close the channel, dropping open streams: the broker cancels their generations (at once,
        or after the re-attach window for a generation with a `request_id`)."""
        self._closed = True
        channel, loop = self._channel, self._loop
        if channel is None or loop is None or loop.is_closed():
            return  # never used, or its loop is gone (and its calls with it): nothing to close
        if loop is not asyncio.get_running_loop():
            raise _wrong_loop_error(None)
        await self._shut(channel)
        guard, self._guard = self._guard, None
        if guard is not None and guard is not asyncio.current_task():
            guard.cancel()

    async def __aenter__(self) -> AsyncKvRelayClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- generations ----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str,
        *,
        negative_prompt: str = "",
        seed: int | None = None,
        width: int = 512,
        height: int = 512,
        num_inference_steps: int = 2,
        guidance_scale: float = 2.0,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncGenerationHandle:
        """Submit a generation; see :meth:`KvRelayClient.generate`."""
        core = _core.new_generation(
            prompt, negative_prompt, seed, width, height, num_inference_steps, guidance_scale,
            request_id, timeout, self._settings.retry,
        )  # fmt: skip
        return AsyncGenerationHandle(self, core)

    async def get_generation(self, request_id: str, *, timeout: float | None = None) -> Generation:
        """The generation now (finished ones are kept for the broker's ``result_ttl_seconds``)."""
        return await self._unary(_core.get_generation(request_id), timeout)

    async def cancel_generation(self, request_id: str, *, timeout: float | None = None) -> Generation:
        """Cancel a generation by id (idempotent); returns it as the broker now knows it."""
        return await self._unary(_core.cancel_generation(request_id), timeout)

    async def list_generations(
        self,
        states: Iterable[GenerationState] | None = None,
        *,
        page_size: int = 0,
        timeout: float | None = None,
    ) -> list[Generation]:
        """Generations (newest first, without images), optionally only those in ``states``: the
        first page (``list_generations_page`` reaches the rest)."""
        return await self._unary(_core.list_generations(states, page_size), timeout)

    async def list_generations_page(
        self,
        states: Iterable[GenerationState] | None = None,
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> GenerationPage:
        """One page of generations: ``page_token`` "" for the first, else the previous page's
        ``next_page_token`` with the same ``states``."""
        return await self._unary(_core.list_generations_page(states, page_size, page_token), timeout)

    # -- broker status --------------------------------------------------------------------------

    async def list_replicas(self, *, timeout: float | None = None) -> list[Replica]:
        """Registered AR and DiT replicas: live ones, lapsed ones and those kept from the journal."""
        return await self._unary(_core.list_replicas(), timeout)

    async def get_replica_registry(self, *, timeout: float | None = None) -> ReplicaRegistry:
        """The replicas, the incarnations forgotten by ``forget_replica`` with ``force=True`` that the
        broker refuses, and how it authenticates replicas: one ``ListReplicas`` answer."""
        return await self._unary(_core.get_replica_registry(), timeout)

    async def get_pools(self, replica_id: str = "", *, timeout: float | None = None) -> list[PoolStatus]:
        """Page accounting of one DiT replica, or of every one when ``replica_id`` is empty."""
        return await self._unary(_core.get_pools(replica_id), timeout)

    async def list_tickets(
        self,
        states: Iterable[TicketState] | None = None,
        *,
        replica_id: str = "",
        timeout: float | None = None,
    ) -> list[Ticket]:
        """Tickets in ``states`` (default: every ticket not RELEASED)."""
        return await self._unary(_core.list_tickets(states, replica_id), timeout)

    async def forget_replica(
        self, replica_id: str, *, force: bool = False, timeout: float | None = None
    ) -> list[str]:
        """Operator: forget a replica gone for good (docs/operations.md, Retiring a replica);
        returns the ids of the tickets that ended with it (only ``force`` ends any; their
        generations run again on another replica while ``broker.max_replica_retries`` allows).
        ``FAILED_PRECONDITION`` (reason ``REPLICA_UP``, ``REPLICA_FENCED``,
        ``REPLICA_HOLDS_TICKETS``, ``REPLICA_HOLDS_PAGES``; with ``force``, ``REPLICA_UP`` and
        ``REPLICA_WRITES_IN_DOUBT``) for one the broker must keep, ``NOT_FOUND`` for an id it
        does not hold (one already forgotten too). Not retried."""
        return await self._unary(_core.forget_replica(replica_id, force), timeout)

    async def reload_credentials(self, *, timeout: float | None = None) -> CredentialsReload:
        """Operator: re-read the broker's credential files (its replica secret or shared
        replica token, its api and operator tokens) and take what changed; the replaced ones are
        still taken for ``security.rotation_grace_seconds`` (docs/operations.md, Rotating the
        replica secret). A credential from an environment variable is ``not reloadable``; nothing
        is taken when any file fails (``error`` says why). Calling it again swaps nothing more."""
        return await self._unary(_core.reload_credentials(), timeout)

    # -- plumbing -------------------------------------------------------------------------------

    async def _unary(self, call: _core.UnaryCall[_T], timeout: float | None) -> _T:
        method = getattr(self._stubs_in_loop(call.request_id)[call.service], call.method)
        attempts = self._settings.attempts(call, timeout)
        while True:
            try:
                response = await method(
                    call.request, timeout=attempts.timeout(), metadata=self._settings.metadata
                )
            except grpc.RpcError as rpc_error:
                delay = attempts.failed(error_from_rpc(rpc_error, request_id=call.request_id))
            else:
                return call.convert(response)
            await asyncio.sleep(delay)

    def _open_generate(self, core: _core.GenerationCore) -> Any:
        call = self._stubs_in_loop(core.request_id)["generation"].Generate(
            core.request, timeout=core.deadline.remaining(), metadata=self._settings.metadata
        )
        self._open_calls.add(call)
        return call


class AsyncGenerationHandle(_core.HandleBase):
    """One submitted generation (asyncio); see :class:`GenerationHandle`.

    ``async with handle:`` cancels the generation if the block exits before it ended. One task
    at a time iterates ``events()`` (another gets ``RuntimeError``); ``result()`` may be awaited
    beside it, as with the blocking handle; ``cancel()`` is safe from any task.
    """

    def __init__(self, client: AsyncKvRelayClient, core: _core.GenerationCore) -> None:
        self._client = client
        self._core = core
        self._iterating = False
        # Held while a task reads the stream (never across a yield to the caller); what result()
        # reads while an events() iterator is open is kept for it (see GenerationHandle).
        self._reading = asyncio.Lock()
        self._pending: collections.deque[GenerationEvent] = collections.deque()
        self._result_reads = 0
        self._call = client._open_generate(core)

    async def events(self) -> AsyncIterator[GenerationEvent]:
        """Events as they happen, ending with the terminal one; see :meth:`GenerationHandle.events`."""
        if self._iterating:
            raise RuntimeError("events() is already being iterated")
        self._iterating = True
        follow: AsyncGenerator[GenerationEvent, None] | None = None
        seen = 0
        try:
            while True:
                async with self._reading:
                    if self._pending:
                        event = self._pending.popleft()
                    else:
                        if follow is None or seen != self._result_reads:
                            if follow is not None:
                                await follow.aclose()
                            seen = self._result_reads
                            follow = self._follow()
                        try:
                            event = await follow.__anext__()
                        except StopAsyncIteration:
                            return
                yield event
                if event.state.is_terminal:
                    return
        finally:
            if follow is not None:
                await follow.aclose()
            self._pending.clear()
            self._iterating = False

    async def result(self) -> GenerationResult:
        """Wait for the end; the image on SUCCEEDED, else :class:`KvRelayError`. May be awaited
        while another task iterates :meth:`events` (or an iterator is left open): it reads the
        stream whenever no iteration is reading it, keeping what it reads for that iterator."""
        while not self._core.done:
            async with self._reading:
                if self._core.done:
                    break
                self._result_reads += 1
                async for event in self._follow():
                    if self._iterating:
                        self._pending.append(event)
        return self._core.result()

    async def cancel(self) -> None:
        """Cancel on the server and drop the stream; see :meth:`GenerationHandle.cancel`."""
        plan = self._core.begin_cancel()
        if plan is None:
            return
        error = None
        if plan.call is not None:
            try:
                self._core.cancel_answered(await self._client._unary(plan.call, CANCEL_TIMEOUT))
            except KvRelayError as err:
                error = self._core.cancel_failed(err)
        self._call.cancel()
        if error is not None:
            raise _core.raisable(error)

    async def __aenter__(self) -> AsyncGenerationHandle:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._core.done:
            try:
                await self.cancel()
            except KvRelayError:
                if exc is None:
                    raise

    # -- internals ------------------------------------------------------------------------------

    async def _follow(self) -> AsyncGenerator[GenerationEvent, None]:
        core = self._core
        ended = core.start_following()
        if ended is not None:
            yield ended
            return
        while True:
            error: KvRelayError | None = None
            try:
                while (message := await self._call.read()) is not grpc.aio.EOF:
                    if (event := core.on_message(message)) is None:
                        continue
                    yield event
                    if core.done:
                        return
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, request_id=core.request_id)
                if self._client._closed and not core.cancel_requested:
                    error = _core.client_closed_error(core.request_id)
            except asyncio.CancelledError:
                # grpc.aio raises CancelledError from a call this handle (or the client's close())
                # cancelled; a cancellation of the task that iterates us must still propagate.
                if _task_is_cancelling():
                    raise
                if not core.cancel_requested:
                    if self._client._closed:
                        error = _core.client_closed_error(core.request_id)
                    else:
                        # An earlier reader's task was cancelled while it read (a timeout around
                        # result()), and grpc.aio cancelled the call with it: a dropped stream,
                        # not a cancellation of this task (found black-box: the next result()
                        # raised a bare CancelledError, also with a request_id to re-attach by).
                        error = _core.stream_cancelled_error(core.request_id, reattachable=core.reattachable)
            decision: _core.StreamEnd | _core.AfterWait = core.on_stream_end(error)
            if isinstance(decision, _core.Wait):
                await asyncio.sleep(decision.seconds)
                decision = core.wait_over()
                if isinstance(decision, _core.Reopen):
                    self._call = self._client._open_generate(core)
                    continue
            if isinstance(decision, _core.Finish):
                yield decision.event
                return
            assert isinstance(decision, _core.Fail)
            raise _core.raisable(decision.error)


# The task grpc.aio runs per streaming call to receive its status from the core
# (grpc/_cython/_cygrpc/aio/call.pyx.pxi); it ends once the core has answered the call, cancelled
# or not. Not a public name: where a grpc release renames it, nothing is found and close() waits
# for nothing (as it did before).
_STATUS_WATCHER = "_AioCall._handle_status_once_received"
SETTLE_TIMEOUT = 5.0


async def _cancelled_calls_settled() -> None:
    """Wait (at most SETTLE_TIMEOUT) until the core has answered every call of this loop that has
    ended here (cancelled: by close(), by a handle's cancel(), by a cancelled reader; a dropped
    call's too, which no handle holds any more) but not yet in grpc's core. Calls still running
    (another client's streams) are not waited for."""
    watchers = [task for task in asyncio.all_tasks() if not task.done() and _watches_an_ended_call(task)]
    if watchers:
        await asyncio.wait(watchers, timeout=SETTLE_TIMEOUT)


def _watches_an_ended_call(task: asyncio.Task[Any]) -> bool:
    coro = task.get_coro()
    if getattr(coro, "__qualname__", "") != _STATUS_WATCHER:
        return False
    # A Cython coroutine has no frame to read `self` from; its closure (a referent) holds it.
    # grpc's internals, not its API: anything unexpected there means "do not wait" (close() must
    # never fail for it).
    try:
        for scope in gc.get_referents(coro):
            for ref in gc.get_referents(scope):
                if isinstance(ref, cygrpc._AioCall):
                    return bool(ref.done())
    except Exception:  # noqa: BLE001
        return False
    return False


async def _orphaned_core_answers_settled(loop: asyncio.AbstractEventLoop) -> None:
    """Wait (at most SETTLE_TIMEOUT) until grpc's core has answered every operation started in
    `loop` whose waiter was cancelled (the tasks of a loop that ends: asyncio.run cancels them all).
    Core holds a CallbackWrapper (referring to the waiter) until it answers, and delivers the
    answer through `loop`: one that has closed by then makes another loop log "Event loop is
    closed". grpc's internals, not its API: anything unexpected means "do not wait"."""
    deadline = loop.time() + SETTLE_TIMEOUT
    pause = 0.002
    while _orphaned_core_operations(loop) and loop.time() < deadline:
        await asyncio.sleep(pause)
        pause = min(0.1, pause * 2)  # each look scans the heap


def _orphaned_core_operations(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        wrapper = cygrpc.CallbackWrapper
        for obj in gc.get_objects():
            # type(), not isinstance(): that reads __class__ of every object on the heap (lazy
            # modules, deprecated aliases: torch warned of one).
            if type(obj) is wrapper:
                for ref in gc.get_referents(obj):
                    if isinstance(ref, asyncio.Future) and ref.get_loop() is loop and ref.cancelled():
                        return True
    except Exception:  # noqa: BLE001
        return False
    return False


def _wrong_loop_error(request_id: str | None) -> KvRelayError:
    return KvRelayError(
        "FAILED_PRECONDITION",
        "WRONG_EVENT_LOOP",
        "this AsyncKvRelayClient's channel belongs to another event loop that is still open "
        "(grpc.aio channels cannot cross loops): create one client per event loop, or close() "
        "it in its loop first",
        request_id=request_id,
    )


def _task_is_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


__all__ = ["AsyncGenerationHandle", "AsyncKvRelayClient"]
