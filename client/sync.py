"""The blocking client: `KvRelayClient` and its `GenerationHandle`, a thin face over `_core`.

Owns one gRPC channel to the broker (which serves GenerationService and BrokerService) and the
blocking I/O: calls, stream reads, sleeps, the lock that lets `cancel()` and `result()` run from
other threads. Every rule (deadlines, which calls are retried, when a stream is re-attached, what
a cancel means) is `_core`'s, shared with the asyncio face. Never lets a `grpc.RpcError` escape:
everything becomes `KvRelayError`.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

import grpc

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


class KvRelayClient(_core.ClientBase):
    """Blocking client for a kvrelay node.

    Example::

        from kvrelay.client import KvRelayClient

        with KvRelayClient("127.0.0.1:50051") as client:
            result = client.generate("a red fox in the snow", seed=7).result()
            result.save("fox.png")

    Args:
        target: the broker's ``host:port`` (default ``127.0.0.1:50051``; a host alone gets port 50051).
        token: bearer token for a broker that requires one (its api token, or the operator
            token for status reads; docs/operations.md, Security).
        tls: use TLS (system roots unless ``root_certificates`` is given).
        timeout: default deadline in seconds of unary calls (reads and cancel); 30 s when None.
            A generation's deadline is the ``timeout`` of :meth:`generate`.
        root_certificates: PEM roots for TLS (implies ``tls``).
        retry: backoff for retried idempotent calls.
        certificate_chain, private_key: PEM client certificate and key, for a broker that
            requires mutual TLS (``security.tls.require_client_cert``; implies ``tls``).
        keepalive_time, keepalive_timeout: HTTP/2 keepalive while a call is open, in seconds
            (15 s, 15 s): a connection that stops answering pings ends its calls UNAVAILABLE
            within their sum instead of at their deadlines. ``keepalive_time=None``: off.
    """

    _channel: grpc.Channel

    def _open_channel(self, settings: _core.ClientSettings) -> grpc.Channel:
        if settings.credentials is None:
            return grpc.insecure_channel(settings.target, options=settings.options)
        return grpc.secure_channel(settings.target, settings.credentials, options=settings.options)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel, dropping open streams: the broker cancels their generations (at once,
        or after the re-attach window for a generation with a `request_id`)."""
        self._closed = True
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
        generation (``ALREADY_EXISTS`` with other parameters). ``seed=None`` lets the server
        choose (the result has it). A value out of the broker's bounds (docs/api.md, Request
        fields) raises :class:`KvRelayError` ``INVALID_ARGUMENT`` naming the field before
        anything is sent; a value of the wrong type (``width="512"``) raises ``TypeError``.
        """
        core = _core.new_generation(
            prompt, negative_prompt, seed, width, height, num_inference_steps, guidance_scale,
            request_id, timeout, self._settings.retry,
        )  # fmt: skip
        return GenerationHandle(self, core)

    def get_generation(self, request_id: str, *, timeout: float | None = None) -> Generation:
        """The generation now (finished ones are kept for the broker's ``result_ttl_seconds``)."""
        return self._unary(_core.get_generation(request_id), timeout)

    def cancel_generation(self, request_id: str, *, timeout: float | None = None) -> Generation:
        """Cancel a generation by id (idempotent); returns it as the broker now knows it."""
        return self._unary(_core.cancel_generation(request_id), timeout)

    def list_generations(
        self,
        states: Iterable[GenerationState] | None = None,
        *,
        page_size: int = 0,
        timeout: float | None = None,
    ) -> list[Generation]:
        """Generations (newest first, without images), optionally only those in ``states``: the
        first page (``list_generations_page`` reaches the rest)."""
        return self._unary(_core.list_generations(states, page_size), timeout)

    def list_generations_page(
        self,
        states: Iterable[GenerationState] | None = None,
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> GenerationPage:
        """One page of generations: ``page_token`` "" for the first, else the previous page's
        ``next_page_token`` with the same ``states``."""
        return self._unary(_core.list_generations_page(states, page_size, page_token), timeout)

    # -- broker status (what `kvrelay status` prints) --------------------------------------------

    def list_replicas(self, *, timeout: float | None = None) -> list[Replica]:
        """Registered AR and DiT replicas: live ones, lapsed ones and those kept from the journal."""
        return self._unary(_core.list_replicas(), timeout)

    def get_replica_registry(self, *, timeout: float | None = None) -> ReplicaRegistry:
        """The replicas, the incarnations forgotten by ``forget_replica`` with ``force=True`` that the
        broker refuses, and how it authenticates replicas: one ``ListReplicas`` answer."""
        return self._unary(_core.get_replica_registry(), timeout)

    def get_pools(self, replica_id: str = "", *, timeout: float | None = None) -> list[PoolStatus]:
        """Page accounting of one DiT replica, or of every one when ``replica_id`` is empty."""
        return self._unary(_core.get_pools(replica_id), timeout)

    def list_tickets(
        self,
        states: Iterable[TicketState] | None = None,
        *,
        replica_id: str = "",
        timeout: float | None = None,
    ) -> list[Ticket]:
        """Tickets in ``states`` (default: every ticket not RELEASED)."""
        return self._unary(_core.list_tickets(states, replica_id), timeout)

    def forget_replica(self, replica_id: str, *, force: bool = False, timeout: float | None = None) -> list[str]:
        """Operator: forget a replica gone for good (docs/operations.md, Retiring a replica);
        returns the ids of the tickets that ended with it (only ``force`` ends any; their
        generations run again on another replica while ``broker.max_replica_retries`` allows).
        ``FAILED_PRECONDITION`` (reason ``REPLICA_UP``, ``REPLICA_FENCED``,
        ``REPLICA_HOLDS_TICKETS``, ``REPLICA_HOLDS_PAGES``; with ``force``, ``REPLICA_UP`` and
        ``REPLICA_WRITES_IN_DOUBT``) for one the broker must keep, ``NOT_FOUND`` for an id it
        does not hold (one already forgotten too). Not retried."""
        return self._unary(_core.forget_replica(replica_id, force), timeout)

    def reload_credentials(self, *, timeout: float | None = None) -> CredentialsReload:
        """Operator: re-read the broker's credential files (its replica secret or shared
        replica token, its api and operator tokens) and take what changed; the replaced ones are
        still taken for ``security.rotation_grace_seconds`` (docs/operations.md, Rotating the
        replica secret). A credential from an environment variable is ``not reloadable``; nothing
        is taken when any file fails (``error`` says why). Calling it again swaps nothing more."""
        return self._unary(_core.reload_credentials(), timeout)

    # -- plumbing -------------------------------------------------------------------------------

    def _unary(self, call: _core.UnaryCall[_T], timeout: float | None) -> _T:
        self._check_open(call.request_id)
        method = getattr(self._stubs[call.service], call.method)
        attempts = self._settings.attempts(call, timeout)
        while True:
            try:
                return call.convert(
                    method(call.request, timeout=attempts.timeout(), metadata=self._settings.metadata)
                )
            except grpc.RpcError as rpc_error:
                delay = attempts.failed(error_from_rpc(rpc_error, request_id=call.request_id))
            time.sleep(delay)

    def _open_generate(self, core: _core.GenerationCore) -> Any:
        self._check_open(core.request_id)
        return self._stubs["generation"].Generate(
            core.request, timeout=core.deadline.remaining(), metadata=self._settings.metadata
        )


class GenerationHandle(_core.HandleBase):
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

    def __init__(self, client: KvRelayClient, core: _core.GenerationCore) -> None:
        self._client = client
        self._core = core
        self._lock = threading.Lock()
        self._iterating = False
        # Held while a thread reads the stream (inside `_follow`, never across a yield to the
        # caller): an events() iterator suspended at an event holds nothing, so result() reads
        # the stream itself instead of waiting for an iteration nobody may ever advance.
        self._reading = threading.Lock()
        # What result() read while an events() iterator was open: that iterator yields these
        # first, so it still sees every event.
        self._pending: collections.deque[GenerationEvent] = collections.deque()
        # Counts result()'s reads: an events() iterator that sees it changed while it was
        # suspended follows the generation again from where it is now.
        self._result_reads = 0
        self._cancel_event = threading.Event()
        # Told each re-attach wait (why the stream ended, seconds to wait): `kvrelay generate`
        # shows it, so a node still starting is not minutes of silence before QUEUED.
        self._on_wait: Callable[[KvRelayError, float], None] | None = None
        self._call = client._open_generate(core)

    def events(self) -> Iterator[GenerationEvent]:
        """Events as they happen, ending with the terminal one (SUCCEEDED, FAILED or CANCELLED).

        A FAILED or CANCELLED generation is an event, not an exception; a failed *call*
        (deadline, server unreachable, rejected request) raises :class:`KvRelayError`. A
        generation the broker runs again (its replica or its KV transfer failed:
        ``broker.max_replica_retries``) goes on in the same events, its ``attempt`` up by one.
        Breaking out of the loop leaves the generation running; a later ``events()`` continues
        where this one stopped. One thread at a time may iterate (another gets ``RuntimeError``);
        :meth:`result` and :meth:`cancel` are safe from any thread.
        """
        with self._lock:
            if self._iterating:
                raise RuntimeError("events() is already being iterated")
            self._iterating = True
        follow: Generator[GenerationEvent, None, None] | None = None
        seen = 0
        try:
            while True:
                with self._reading:
                    if self._pending:
                        event = self._pending.popleft()
                    else:
                        if follow is None or seen != self._result_reads:
                            if follow is not None:
                                follow.close()
                            seen = self._result_reads
                            follow = self._follow()
                        try:
                            event = next(follow)
                        except StopIteration:
                            return
                yield event
                if event.state.is_terminal:
                    return
        finally:
            if follow is not None:
                follow.close()
            self._pending.clear()
            self._iterating = False

    def result(self) -> GenerationResult:
        """Wait for the end; the image on SUCCEEDED, else :class:`KvRelayError` with the reason.

        May be called while another thread iterates :meth:`events`, or while an ``events()``
        iterator is left open between two events: it reads the stream whenever no iteration is
        reading it, keeping what it reads for the open iterator (which still sees every event).
        """
        while not self._core.done:
            with self._reading:
                if self._core.done:
                    break
                self._result_reads += 1
                for event in self._follow():
                    if self._iterating:
                        self._pending.append(event)
        return self._core.result()

    def cancel(self) -> None:
        """Cancel the generation on the server and drop the stream.

        Idempotent; a no-op once the generation has ended. Raises :class:`KvRelayError` only
        when the server could not be told (the dropped stream still cancels it server-side).
        """
        with self._lock:
            plan = self._core.begin_cancel()
        if plan is None:
            return
        self._cancel_event.set()
        error = None
        if plan.call is not None:
            try:
                self._core.cancel_answered(self._client._unary(plan.call, CANCEL_TIMEOUT))
            except KvRelayError as err:
                error = self._core.cancel_failed(err)
        self._call.cancel()
        if error is not None:
            raise _core.raisable(error)

    def __enter__(self) -> GenerationHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._core.done:
            try:
                self.cancel()
            except KvRelayError:
                if exc is None:
                    raise

    # -- internals ------------------------------------------------------------------------------

    def _follow(self) -> Generator[GenerationEvent, None, None]:
        core = self._core
        ended = core.start_following()
        if ended is not None:
            yield ended
            return
        while True:
            error: KvRelayError | None = None
            try:
                for message in self._call:
                    if (event := core.on_message(message)) is None:
                        continue
                    yield event
                    if core.done:
                        return
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, request_id=core.request_id)
                # grpc's streaming call raises itself: its traceback's frames hold the call (and
                # this handle, which holds the call), a cycle only the cyclic GC would free.
                rpc_error.__traceback__ = None
                if self._client._closed and not core.cancel_requested:
                    error = _core.client_closed_error(core.request_id)
            decision: _core.StreamEnd | _core.AfterWait = core.on_stream_end(error)
            if isinstance(decision, _core.Wait):
                if self._on_wait is not None and decision.error is not None:
                    self._on_wait(decision.error, decision.seconds)
                self._cancel_event.wait(decision.seconds)  # a cancel() ends the wait early
                with self._lock:  # so that cancel() either sees the new call or stops the reopen
                    decision = core.wait_over()
                    if isinstance(decision, _core.Reopen):
                        self._call = self._client._open_generate(core)
                        continue
            if isinstance(decision, _core.Finish):
                yield decision.event
                return
            assert isinstance(decision, _core.Fail)
            raise _core.raisable(decision.error)


__all__ = ["GenerationHandle", "KvRelayClient"]
