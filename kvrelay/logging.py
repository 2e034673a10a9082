"""One logging setup for every kvrelay process (structlog over stdlib logging).

Console rendering when attached to a terminal, JSON lines otherwise; `request_id` and `ticket_id`
are bound through contextvars (by `bind_request` or the gRPC interceptor), never passed by hand.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
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


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: Any) -> Any:
        with bind_request(**_ids_from_request(request, context.invocation_metadata())):
            return await behavior(request, context)

    return wrapper


def _wrap_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(request: Any, context: Any) -> Any:
        with bind_request(**_ids_from_request(request, context.invocation_metadata())):
            async for item in behavior(request, context):
                yield item

    return wrapper


def logging_interceptor() -> Any:
    """A grpc.aio server interceptor binding request_id/ticket_id (from the request message or
    metadata) to every log line a handler writes."""
    import grpc

    class _Interceptor(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
            handler = await continuation(handler_call_details)
            if handler is None:
                return None
            if handler.unary_unary is not None:
                return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
            if handler.unary_stream is not None:
                return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
            return handler

    return _Interceptor()
