"""One logging setup for every kvrelay process (structlog over stdlib logging).

Console rendering when attached to a terminal, JSON lines otherwise; `request_id` and `ticket_id`
are bound through contextvars (by `bind_request` or the gRPC interceptor), never passed by hand.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import Any

import structlog

_configured = False

# gRPC metadata keys the interceptor binds into the log context.
_METADATA_KEYS = ("request_id", "ticket_id")


def configure_logging(level: str | None = None, *, process: str | None = None, json: bool | None = None) -> None:
    """Set up structlog and stdlib logging once per process.

    `json=None` picks JSON when stderr is not a terminal. KVRELAY_LOG_LEVEL / KVRELAY_LOG_FORMAT
    (console|json) override.
    """
    global _configured
    level_name = (level or os.environ.get("KVRELAY_LOG_LEVEL") or "INFO").upper()
    fmt = os.environ.get("KVRELAY_LOG_FORMAT")
    use_json = json if json is not None else (fmt == "json" if fmt else not sys.stderr.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_name)
    for noisy in ("asyncio", "grpc._cython", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    if process:
        structlog.contextvars.bind_contextvars(process=process, pid=os.getpid())
    _configured = True


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)


@contextmanager
def bind_request(**ids: str) -> Iterator[None]:
    """Bind ids (request_id, ticket_id, ...) to every log line inside the block."""
    clean = {k: v for k, v in ids.items() if v}
    tokens = structlog.contextvars.bind_contextvars(**clean)
    try:
        yield
    finally:
        try:
            structlog.contextvars.reset_contextvars(**tokens)
        except ValueError:
            # A stream handler closed from another context (a cancelled RPC's generator finalised
            # by grpc) cannot reset tokens of this one; that context is gone with its ids anyway.
            pass


def _ids_from_request(request: Any, metadata: Any) -> dict[str, str]:
    ids: dict[str, str] = {}
    for key in _METADATA_KEYS:
        value = getattr(request, key, None) if request is not None else None
        if isinstance(value, str) and value:
            ids[key] = value
    for key, value in metadata or ():
        if key in _METADATA_KEYS and isinstance(value, str) and value:
            ids.setdefault(key, value)
    return ids


class _Malformed:
    """What a request that could not be decoded deserializes to: the handler never sees it."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    # grpc answers a deserializer that raises with UNKNOWN and logs a traceback per call (a log
    # flood anyone can cause); decoding failures become a value the wrapper turns into one line
    # and INVALID_ARGUMENT.
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as err:  # noqa: BLE001 - DecodeError and whatever a custom decoder raises
            return _Malformed(err)

    return deserialize


async def _reject_malformed(method: str, request: _Malformed, context: Any) -> None:
    import grpc

    get_logger(__name__).warning(
        "malformed_request", method=method, error=f"{type(request.error).__name__}: {request.error}"[:200]
    )
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the {method} request message could not be decoded")


async def _checked_stream(method: str, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
    async for item in requests:
        if isinstance(item, _Malformed):
            await _reject_malformed(method, item, context)
        yield item


Around = Callable[[str, Any, Any], AbstractAsyncContextManager[None]]
"""(method, request or None for client streams, context) -> the block one call runs inside."""


def wrap_handler(handler: Any, method: str, around: Around) -> Any:
    """`handler` (a grpc.RpcMethodHandler) with each call run inside `around(method, request, context)`.

    Covers the four kinds of RPC and both styles of streaming handler grpc.aio accepts: an async
    generator, or a coroutine that writes with `context.write` (the health service's Watch). grpc
    picks the style from the function it is given, so the wrapper keeps the style of the original.
    """
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return handler._replace(**{kind: _wrap_behavior(behavior, method, around)})
    return handler


def _wrap_behavior(behavior: Callable[..., Any], method: str, around: Around) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream_wrapper(request: Any, context: Any) -> AsyncIterator[Any]:
            async with around(method, request, context):
                async for item in behavior(request, context):
                    yield item

        return stream_wrapper

    async def wrapper(request: Any, context: Any) -> Any:
        async with around(method, request, context):
            return await behavior(request, context)

    return wrapper


@asynccontextmanager
async def _bind_call(method: str, request: Any, context: Any) -> AsyncIterator[None]:
    if isinstance(request, _Malformed):
        await _reject_malformed(method, request, context)
    ids = _ids_from_request(None if hasattr(request, "__aiter__") else request, context.invocation_metadata())
    with bind_request(**ids):
        yield


def logging_interceptor() -> Any:
    """A grpc.aio server interceptor binding request_id/ticket_id (from the request message or
    metadata) to every log line a handler writes, and answering a request that cannot be decoded
    with INVALID_ARGUMENT and one warning line (not grpc's UNKNOWN and a traceback)."""
    import grpc

    class _Interceptor(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
            handler = await continuation(handler_call_details)
            if handler is None:
                return None
            method = handler_call_details.method
            handler = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
            if handler.request_streaming:
                for kind in ("stream_unary", "stream_stream"):
                    behavior = getattr(handler, kind)
                    if behavior is not None:
                        handler = handler._replace(**{kind: _checking_requests(behavior, method)})
            return wrap_handler(handler, method, _bind_call)

    return _Interceptor()


def _checking_requests(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    # Client-streaming handlers get their requests through an iterator: a malformed message in
    # the middle of the stream ends the call the same way.
    if inspect.isasyncgenfunction(behavior):

        async def stream_wrapper(requests: Any, context: Any) -> AsyncIterator[Any]:
            async for item in behavior(_checked_stream(method, requests, context), context):
                yield item

        return stream_wrapper

    async def wrapper(requests: Any, context: Any) -> Any:
        return await behavior(_checked_stream(method, requests, context), context)

    return wrapper
