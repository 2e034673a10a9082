"""The asyncio client: `AsyncKvRelayClient` and its `AsyncGenerationHandle` (grpc.aio).

Same rules as the blocking client (deadline on every call, retries only where safe, only
`KvRelayError` escapes). A channel belongs to the event loop it was created on: create the
client inside the loop that uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio

from kvrelay.v1 import broker_pb2, broker_pb2_grpc, generation_pb2, generation_pb2_grpc

from ._common import (
    CANCEL_TIMEOUT,
    DEFAULT_GENERATE_TIMEOUT,
    DEFAULT_RPC_TIMEOUT,
    DEFAULT_TARGET,
    Deadline,
    Reattach,
    RetryPolicy,
    build_generate_request,
    call_metadata,
    cancelled_by_client_event,
    channel_credentials,
    channel_options,
    deadline_error,
    enum_values,
    result_from_event,
    stream_ended_error,
)
from .errors import KvRelayError, error_from_rpc
from .types import (
    Generation,
    GenerationEvent,
    GenerationResult,
    GenerationState,
    PoolStatus,
    Replica,
    Ticket,
    TicketState,
    event_from_generation,
    event_from_pb,
    generation_from_pb,
    pool_from_pb,
    replica_from_pb,
    ticket_from_pb,
)

_T = TypeVar("_T")

_NOTHING_TO_CANCEL = frozenset({"NOT_FOUND", "FAILED_PRECONDITION"})


class AsyncKvRelayClient:
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

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        tls: bool = False,
        timeout: float | None = None,
        root_certificates: bytes | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.target = target
        self._timeout = timeout if timeout is not None else DEFAULT_RPC_TIMEOUT
        self._metadata = call_metadata(token)
        self._retry = retry or RetryPolicy()
        credentials = channel_credentials(tls, root_certificates)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=channel_options())
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=channel_options())
        self._generation = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._broker = broker_pb2_grpc.BrokerServiceStub(self._channel)

    async def close(self) -> None:
        """Close the channel; open streams are cancelled (and so are their generations)."""
        await self._channel.close()

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
        request = build_generate_request(
            prompt,
            negative_prompt=negative_prompt,
            seed=seed,
            width=width,
            height=height,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            request_id=request_id,
        )
        deadline = Deadline(timeout if timeout is not None else DEFAULT_GENERATE_TIMEOUT)
        return AsyncGenerationHandle(self, request, deadline)

    async def get_generation(self, request_id: str, *, timeout: float | None = None) -> Generation:
        response = await self._unary(
            self._generation.GetGeneration,
            generation_pb2.GetGenerationRequest(request_id=request_id),
            timeout,
            idempotent=True,
            request_id=request_id,
        )
        return generation_from_pb(response.generation)

    async def cancel_generation(self, request_id: str, *, timeout: float | None = None) -> Generation:
        response = await self._unary(
            self._generation.CancelGeneration,
            generation_pb2.CancelGenerationRequest(request_id=request_id),
            timeout,
            idempotent=True,
            request_id=request_id,
        )
        return generation_from_pb(response.generation)

    async def list_generations(
        self,
        states: Iterable[GenerationState] | None = None,
        *,
        page_size: int = 0,
        timeout: float | None = None,
    ) -> list[Generation]:
        request = generation_pb2.ListGenerationsRequest(states=enum_values(states), page_size=page_size)
        response = await self._unary(self._generation.ListGenerations, request, timeout, idempotent=True)
        return [generation_from_pb(g) for g in response.generations]

    # -- broker status --------------------------------------------------------------------------

    async def list_replicas(self, *, timeout: float | None = None) -> list[Replica]:
        response = await self._unary(
            self._broker.ListReplicas, broker_pb2.ListReplicasRequest(), timeout, idempotent=True
        )
        return [replica_from_pb(r) for r in response.replicas]

    async def get_pools(self, replica_id: str = "", *, timeout: float | None = None) -> list[PoolStatus]:
        response = await self._unary(
            self._broker.GetPool, broker_pb2.GetPoolRequest(replica_id=replica_id), timeout, idempotent=True
        )
        return [pool_from_pb(p) for p in response.pools]

    async def list_tickets(
        self,
        states: Iterable[TicketState] | None = None,
        *,
        replica_id: str = "",
        timeout: float | None = None,
    ) -> list[Ticket]:
        request = broker_pb2.ListTicketsRequest(states=enum_values(states), replica_id=replica_id)
        response = await self._unary(self._broker.ListTickets, request, timeout, idempotent=True)
        return [ticket_from_pb(t) for t in response.tickets]

    # -- plumbing -------------------------------------------------------------------------------

    async def _unary(
        self,
        method: Callable[..., Awaitable[_T]],
        request: Any,
        timeout: float | None,
        *,
        idempotent: bool,
        request_id: str | None = None,
    ) -> _T:
        deadline = Deadline(timeout if timeout is not None else self._timeout)
        backoffs = self._retry.backoffs() if idempotent else iter(())
        while True:
            try:
                return await method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, request_id=request_id)
            delay = next(backoffs, None) if error.retryable else None
            if delay is None or not deadline.allows_sleep(delay):
                raise error
            await asyncio.sleep(delay)

    def _open_generate(self, request: generation_pb2.GenerateRequest, deadline: Deadline) -> Any:
        return self._generation.Generate(request, timeout=deadline.remaining(), metadata=self._metadata)


class AsyncGenerationHandle:
    """One submitted generation (asyncio); see :class:`GenerationHandle`.

    ``async with handle:`` cancels the generation if the block exits before it ended. One task
    at a time reads the stream (``events()`` or ``result()``); ``cancel()`` is safe from any task.
    """

    def __init__(
        self, client: AsyncKvRelayClient, request: generation_pb2.GenerateRequest, deadline: Deadline
    ) -> None:
        self._client = client
        self._request = request
        self._deadline = deadline
        self._reattach = bool(request.request_id)
        self._request_id: str | None = request.request_id or None
        self._cancel_requested = False
        self._cancel_outcome: GenerationEvent | None = None
        self._last: GenerationEvent | None = None
        self._terminal: GenerationEvent | None = None
        self._call = client._open_generate(request, deadline)

    @property
    def request_id(self) -> str | None:
        return self._request_id

    @property
    def last_event(self) -> GenerationEvent | None:
        return self._last

    @property
    def done(self) -> bool:
        return self._terminal is not None

    async def events(self) -> AsyncIterator[GenerationEvent]:
        """Events as they happen, ending with the terminal one; see :meth:`GenerationHandle.events`."""
        async for event in self._follow():
            yield event

    async def result(self) -> GenerationResult:
        """Wait for the end; the image on SUCCEEDED, else :class:`KvRelayError`."""
        if self._terminal is None:
            async for _ in self.events():
                pass
        assert self._terminal is not None
        return result_from_event(self._terminal)

    async def cancel(self) -> None:
        """Cancel on the server and drop the stream; see :meth:`GenerationHandle.cancel`."""
        if self._terminal is not None or self._cancel_requested:
            return
        self._cancel_requested = True
        error: KvRelayError | None = None
        if self._request_id:
            try:
                generation = await self._client.cancel_generation(self._request_id, timeout=CANCEL_TIMEOUT)
            except KvRelayError as err:
                if err.code not in _NOTHING_TO_CANCEL:
                    error = err
            else:
                if generation.state.is_terminal:
                    self._cancel_outcome = event_from_generation(generation)
        self._call.cancel()
        if error is not None:
            raise error

    async def __aenter__(self) -> AsyncGenerationHandle:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._terminal is None:
            try:
                await self.cancel()
            except KvRelayError:
                if exc is None:
                    raise

    # -- internals ------------------------------------------------------------------------------

    async def _follow(self) -> AsyncIterator[GenerationEvent]:
        reattach = Reattach(self._client._retry, self._deadline)
        while self._terminal is None:
            error: KvRelayError
            try:
                while True:
                    message = await self._call.read()
                    if message is grpc.aio.EOF:
                        error = stream_ended_error(self._request_id)
                        break
                    event = event_from_pb(message)
                    self._observe(event)
                    reattach.progressed()
                    yield event
                    if self._terminal is not None:
                        return
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, request_id=self._request_id)
            except asyncio.CancelledError:
                # grpc.aio raises CancelledError from a call this handle cancelled; a cancellation
                # of the task that iterates us must still propagate.
                if not self._cancel_requested or _task_is_cancelling():
                    raise
                error = cancelled_error(self._request_id)
            if self._cancel_requested:
                yield self._finish_cancelled()
                return
            if self._deadline.expired() and error.code != "DEADLINE_EXCEEDED":
                error = deadline_error("Generate", self._request_id)
            delay = reattach.next_delay(error) if (self._reattach and error.retryable) else None
            if delay is None:
                raise error
            await asyncio.sleep(delay)
            if self._cancel_requested:
                yield self._finish_cancelled()
                return
            self._call = self._client._open_generate(self._request, self._deadline)

    def _observe(self, event: GenerationEvent) -> None:
        if event.request_id:
            self._request_id = event.request_id
        self._last = event
        if event.state.is_terminal:
            self._terminal = event

    def _finish_cancelled(self) -> GenerationEvent:
        event = self._cancel_outcome or cancelled_by_client_event(self._request_id or "")
        self._observe(event)
        return event


def cancelled_error(request_id: str | None) -> KvRelayError:
    return KvRelayError("CANCELLED", "CANCELLED_BY_CLIENT", "the call was cancelled", request_id=request_id)


def _task_is_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


__all__ = ["AsyncGenerationHandle", "AsyncKvRelayClient"]
