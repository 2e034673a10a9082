"""The blocking client: `KvRelayClient` and its `GenerationHandle`.

Owns one gRPC channel to the broker (which serves GenerationService and BrokerService). Every
call gets a deadline; reads are retried on UNAVAILABLE; `Generate` is re-issued only to re-attach
to a `request_id` the caller chose (the server makes that idempotent). Never lets a
`grpc.RpcError` escape: everything becomes `KvRelayError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

import grpc

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

# Codes a CancelGeneration may answer when there is nothing left to cancel.
_NOTHING_TO_CANCEL = frozenset({"NOT_FOUND", "FAILED_PRECONDITION"})


class KvRelayClient:
    """Blocking client for a kvrelay node.

    Example::

        from kvrelay.client import KvRelayClient

        with KvRelayClient("127.0.0.1:50051") as client:
            result = client.generate("a red fox in the snow", seed=7).result()
            result.save("fox.png")

    Args:
        target: the broker's ``host:port``.
        token: bearer token for a broker that requires one (``broker.api_token``).
        tls: use TLS (system roots unless ``root_certificates`` is given).
        timeout: default deadline in seconds of unary calls (reads and cancel); 30 s when None.
            A generation's deadline is the ``timeout`` of :meth:`generate`.
        root_certificates: PEM roots for TLS (implies ``tls``).
        retry: backoff for retried idempotent calls.
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
            self._channel = grpc.insecure_channel(target, options=channel_options())
        else:
            self._channel = grpc.secure_channel(target, credentials, options=channel_options())
        self._generation = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._broker = broker_pb2_grpc.BrokerServiceStub(self._channel)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel; streams still open are cancelled (and so are their generations)."""
        self._channel.close()

    def __enter__(self) -> KvRelayClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- generations ----------------------------------------------------------------------------

    def generate(
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
    ) -> GenerationHandle:
        """Submit a generation and return its handle at once (the stream is already open).

        ``timeout`` (default 600 s) bounds the whole generation and travels with it into the
        AR and DiT stages. With a ``request_id`` the call is idempotent: a lost stream is
        re-attached, and a second ``generate`` with the same id and parameters follows the same
        generation (``ALREADY_EXISTS`` with other parameters).
        """
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
        return GenerationHandle(self, request, deadline)

    def get_generation(self, request_id: str, *, timeout: float | None = None) -> Generation:
        """The generation now (finished ones are kept for the broker's ``result_ttl_seconds``)."""
        response = self._unary(
            self._generation.GetGeneration,
            generation_pb2.GetGenerationRequest(request_id=request_id),
            timeout,
            idempotent=True,
            request_id=request_id,
        )
        return generation_from_pb(response.generation)

    def cancel_generation(self, request_id: str, *, timeout: float | None = None) -> Generation:
        """Cancel a generation by id (idempotent); returns it as the broker now knows it."""
        response = self._unary(
            self._generation.CancelGeneration,
            generation_pb2.CancelGenerationRequest(request_id=request_id),
            timeout,
            idempotent=True,
            request_id=request_id,
        )
        return generation_from_pb(response.generation)

    def list_generations(
        self,
        states: Iterable[GenerationState] | None = None,
        *,
        page_size: int = 0,
        timeout: float | None = None,
    ) -> list[Generation]:
        """Generations (newest first, without images), optionally only those in ``states``."""
        request = generation_pb2.ListGenerationsRequest(states=enum_values(states), page_size=page_size)
        response = self._unary(self._generation.ListGenerations, request, timeout, idempotent=True)
        return [generation_from_pb(g) for g in response.generations]

    # -- broker status (what `kvrelay status` prints) --------------------------------------------

    def list_replicas(self, *, timeout: float | None = None) -> list[Replica]:
        response = self._unary(
            self._broker.ListReplicas, broker_pb2.ListReplicasRequest(), timeout, idempotent=True
        )
        return [replica_from_pb(r) for r in response.replicas]

    def get_pools(self, replica_id: str = "", *, timeout: float | None = None) -> list[PoolStatus]:
        """Page accounting of one DiT replica, or of every one when ``replica_id`` is empty."""
        response = self._unary(
            self._broker.GetPool, broker_pb2.GetPoolRequest(replica_id=replica_id), timeout, idempotent=True
        )
        return [pool_from_pb(p) for p in response.pools]

    def list_tickets(
        self,
        states: Iterable[TicketState] | None = None,
        *,
        replica_id: str = "",
        timeout: float | None = None,
    ) -> list[Ticket]:
        """Tickets in ``states`` (default: every ticket not RELEASED)."""
        request = broker_pb2.ListTicketsRequest(states=enum_values(states), replica_id=replica_id)
        response = self._unary(self._broker.ListTickets, request, timeout, idempotent=True)
        return [ticket_from_pb(t) for t in response.tickets]

    # -- plumbing -------------------------------------------------------------------------------

    def _unary(
        self,
        method: Callable[..., _T],
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
                return method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, request_id=request_id)
            delay = next(backoffs, None) if error.retryable else None
            if delay is None or not deadline.allows_sleep(delay):
                raise error
            time.sleep(delay)

    def _open_generate(self, request: generation_pb2.GenerateRequest, deadline: Deadline) -> Any:
        return self._generation.Generate(request, timeout=deadline.remaining(), metadata=self._metadata)


class GenerationHandle:
    """One submitted generation: follow it with :meth:`events`, wait with :meth:`result`,
    stop it with :meth:`cancel`.

    Use it as a context manager to cancel the generation if the block exits before it ends::

        with client.generate("a lighthouse at dusk", num_inference_steps=8) as handle:
            for event in handle.events():
                print(event.state.name, event.step, event.total_steps)
            handle.result().save("lighthouse.png")

    Methods may be called from different threads: ``cancel()`` from one while another iterates
    ``events()`` ends that iteration with a CANCELLED event.
    """

    def __init__(
        self, client: KvRelayClient, request: generation_pb2.GenerateRequest, deadline: Deadline
    ) -> None:
        self._client = client
        self._request = request
        self._deadline = deadline
        self._reattach = bool(request.request_id)
        self._request_id: str | None = request.request_id or None
        self._lock = threading.Lock()
        self._iterating = False
        self._cancel_requested = False
        self._cancel_event = threading.Event()
        self._cancel_outcome: GenerationEvent | None = None
        self._last: GenerationEvent | None = None
        self._terminal: GenerationEvent | None = None
        # Set when the thread following the stream saw the end (terminal event or call failure).
        self._ended = threading.Event()
        self._failure: KvRelayError | None = None
        self._call = client._open_generate(request, deadline)

    @property
    def request_id(self) -> str | None:
        """The generation's id: the caller's, or the server's once the first event arrived."""
        return self._request_id

    @property
    def last_event(self) -> GenerationEvent | None:
        return self._last

    @property
    def done(self) -> bool:
        return self._terminal is not None

    def events(self) -> Iterator[GenerationEvent]:
        """Events as they happen, ending with the terminal one (SUCCEEDED, FAILED or CANCELLED).

        A FAILED or CANCELLED generation is an event, not an exception; a failed *call*
        (deadline, server unreachable, rejected request) raises :class:`KvRelayError`. Breaking
        out of the loop leaves the generation running; a later ``events()`` continues where
        this one stopped. One thread at a time may iterate (another gets ``RuntimeError``);
        :meth:`result` and :meth:`cancel` are safe from any thread.
        """
        with self._lock:
            if self._iterating:
                raise RuntimeError("events() is already being iterated")
            self._iterating = True
        try:
            yield from self._follow()
        finally:
            self._iterating = False

    def result(self) -> GenerationResult:
        """Wait for the end; the image on SUCCEEDED, else :class:`KvRelayError` with the reason.

        May be called while another thread iterates :meth:`events`: it then waits for that
        iteration to see the end.
        """
        while self._terminal is None:
            with self._lock:
                mine = not self._iterating
                if mine:
                    self._iterating = True
            if mine:
                try:
                    for _ in self._follow():
                        pass
                finally:
                    self._iterating = False
            elif self._ended.wait(0.1) and self._terminal is None and self._failure is not None:
                raise self._failure
        return result_from_event(self._terminal)

    def cancel(self) -> None:
        """Cancel the generation on the server and drop the stream.

        Idempotent; a no-op once the generation has ended. Raises :class:`KvRelayError` only
        when the server could not be told (the dropped stream still cancels it server-side).
        """
        with self._lock:
            if self._terminal is not None or self._cancel_requested:
                return
            self._cancel_requested = True
        self._cancel_event.set()
        error: KvRelayError | None = None
        if self._request_id:
            try:
                generation = self._client.cancel_generation(self._request_id, timeout=CANCEL_TIMEOUT)
            except KvRelayError as err:
                if err.code not in _NOTHING_TO_CANCEL:
                    error = err
            else:
                if generation.state.is_terminal:
                    # The server's word on how it ended (it may have finished before the cancel).
                    self._cancel_outcome = event_from_generation(generation)
        self._call.cancel()
        if error is not None:
            raise error

    def __enter__(self) -> GenerationHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._terminal is None:
            try:
                self.cancel()
            except KvRelayError:
                if exc is None:
                    raise

    # -- internals ------------------------------------------------------------------------------

    def _follow(self) -> Iterator[GenerationEvent]:
        self._ended.clear()
        self._failure = None
        reattach = Reattach(self._client._retry, self._deadline)
        while self._terminal is None:
            error: KvRelayError | None = None
            try:
                for message in self._call:
                    event = event_from_pb(message)
                    self._observe(event)
                    reattach.progressed()
                    yield event
                    if self._terminal is not None:
                        return
                error = stream_ended_error(self._request_id)
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, request_id=self._request_id)
            if self._cancel_requested:
                yield self._finish_cancelled()
                return
            if self._deadline.expired() and error.code != "DEADLINE_EXCEEDED":
                error = deadline_error("Generate", self._request_id)
            delay = reattach.next_delay(error) if (self._reattach and error.retryable) else None
            if delay is None:
                self._failure = error
                self._ended.set()
                raise error
            self._cancel_event.wait(delay)  # a cancel() ends the wait early
            with self._lock:
                cancelled = self._cancel_requested
                if not cancelled:
                    # Same request_id and parameters: the server attaches to the existing generation.
                    self._call = self._client._open_generate(self._request, self._deadline)
            if cancelled:
                yield self._finish_cancelled()
                return

    def _observe(self, event: GenerationEvent) -> None:
        if event.request_id:
            self._request_id = event.request_id
        self._last = event
        if event.state.is_terminal:
            self._terminal = event
            self._ended.set()

    def _finish_cancelled(self) -> GenerationEvent:
        event = self._cancel_outcome or cancelled_by_client_event(self._request_id or "")
        self._observe(event)
        return event


__all__ = ["GenerationHandle", "KvRelayClient"]
