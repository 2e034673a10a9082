"""One logging setup for every kvrelay process (structlog over stdlib logging).

Console rendering when attached to a terminal, JSON lines otherwise; `request_id` and `ticket_id`
are bound through contextvars (by `bind_request` or the gRPC interceptor), never passed by hand.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import json as jsonlib
import logging
import os
import re
import select
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from datetime import UTC, datetime
from typing import Any

import structlog

_configured = False
_json_logging = False

# gRPC metadata keys the interceptor binds into the log context.
_METADATA_KEYS = ("request_id", "ticket_id")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is at the time of the record (a test's capture that was
    closed since, or a replaced stream, never breaks logging)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


# gRPC core (absl) logs at INFO unless told otherwise: every stop of a node printed absl's
# "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR" and
# "I0000 ... chttp2_transport.cc:1183] ipv4:...: Got goaway [2] ... Cancelling all calls" (a
# channel to a process that stopped: routine). ERROR keeps gRPC's real errors (a failed bind);
# a GRPC_VERBOSITY the user set wins, and a GRPC_TRACE (its lines are INFO) leaves it unset. gRPC
# reads it when it first starts (the first channel or server of the process), so processes set it
# before that, and children inherit it.
GRPC_CORE_LOG_DEFAULTS: dict[str, str] = {"GRPC_VERBOSITY": "ERROR"}


def with_quiet_grpc_core(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` plus GRPC_CORE_LOG_DEFAULTS for what it does not set itself (nothing when it
    asks for gRPC traces)."""
    if environ.get("GRPC_TRACE"):
        return dict(environ)
    return {**GRPC_CORE_LOG_DEFAULTS, **environ}


def quiet_grpc_core() -> None:
    """Apply GRPC_CORE_LOG_DEFAULTS to this process's environment (and so to its children's)."""
    for key, value in with_quiet_grpc_core(os.environ).items():
        os.environ.setdefault(key, value)


# Loggers cache their processors on first use (fast). The tests turn it off (tests/conftest.py):
# a logger cached under one test's config is not seen by a later test's capture_logs.
CACHE_LOGGERS = True


def configure_logging(level: str | None = None, *, process: str | None = None, json: bool | None = None) -> None:
    """Set up structlog and stdlib logging once per process.

    `json=None` picks JSON when stderr is not a terminal. KVRELAY_LOG_LEVEL / KVRELAY_LOG_FORMAT
    (console|json) override.
    """
    global _configured, _json_logging
    quiet_grpc_core()
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
    handler = _StderrHandler()
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
        cache_logger_on_first_use=CACHE_LOGGERS,
    )
    if process:
        structlog.contextvars.bind_contextvars(process=process, pid=os.getpid())
    _configured = True
    _json_logging = use_json


# ---------------------------------------------------------------- native output (fds 1 and 2)

# glog / absl: "I1202 14:35:15.755330  7688 transfer_metadata.cpp:616] message"
_GLOG = re.compile(rb"^([IWEF])\d{4} (\d\d:\d\d:\d\d\.\d+)\s+(\d+) ([^\]\s]+)\] ?(.*)$")
_GLOG_LEVELS = {b"I": "info", b"W": "warning", b"E": "error", b"F": "critical"}
# Native messages that are errors by their severity letter but routine on every healthy run.
_ROUTINE = (
    # Mooncake looks its own segment up before it has published it (every engine start).
    b"Local segment descriptor not found",
)


# kvrelay.stopping's lines on a stop signal: the first (a stop) and a second (a fast stop).
_REQUESTED_STOP = re.compile(rb"^kvrelay [\w-]+: SIG[A-Z]+(: stopping| again: fast stop) \(")


class _NativeCapture:
    """Fds 1 and 2 of this process (and of every worker it forks) go through pipes; a thread per
    fd forwards JSON lines as they are and wraps every other line (Mooncake's glog, absl, a
    Python traceback, a print) into one JSON record, so every line of the log is JSON."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self._fields = fields
        self._streams: list[tuple[int, int, threading.Thread]] = []
        # Processes this one starts (rank workers, multiprocessing's resource tracker) inherit the
        # pipes and may outlive our interest in them: the pumps never wait for an end of file at
        # exit; close() wakes them to forward what is buffered and return.
        self._wake_read, self._wake_write = os.pipe()
        for fd, name in ((1, "stdout"), (2, "stderr")):
            original = os.dup(fd)
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            os.dup2(write_end, fd)
            os.close(write_end)
            thread = threading.Thread(
                target=self._pump, args=(read_end, original, name), name=f"kvrelay-native-{name}", daemon=True
            )
            thread.start()
            self._streams.append((fd, original, thread))

    def _pump(self, read_end: int, out: int, stream: str) -> None:
        pending = b""
        closing = False
        while True:
            ready, _, _ = select.select([read_end, self._wake_read], [], [])
            closing = closing or self._wake_read in ready
            ended = False
            while True:  # everything available now (all of it once closing)
                try:
                    chunk = os.read(read_end, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    chunk = b""
                if not chunk:
                    ended = True
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if lines:
                    _write_all(out, b"".join(self._render(line, stream) for line in lines))
            if ended or closing:
                break
        if pending:
            _write_all(out, self._render(pending, stream))
        os.close(read_end)

    def _render(self, line: bytes, stream: str) -> bytes:
        line = line.rstrip(b"\r")
        if line.startswith(b"{") and line.endswith(b"}"):
            try:
                jsonlib.loads(line)
                return line + b"\n"
            except ValueError:
                pass
        if not line.strip():
            return b""
        record: dict[str, Any] = {"event": "native_output", "stream": stream}
        match = _GLOG.match(line)
        if match is not None:
            letter, _time, thread, source, message = match.groups()
            level = _GLOG_LEVELS[letter]
            if level == "error" and any(text in message for text in _ROUTINE):
                level = "info"
            record.update(
                level=level,
                line=message.decode(errors="replace"),
                source=source.decode(errors="replace"),
                thread=int(thread),
            )
        else:
            # Our processes print their one-line failure as "kvrelay <role>: ..." on stderr, and the
            # lines of a stop they were asked for, which are no failure: every graceful stop of a
            # node logged "kvrelay broker: SIGTERM: stopping (serving)" at error.
            level = "info" if stream == "stdout" else "error" if line.startswith(b"kvrelay ") else "warning"
            stop = _REQUESTED_STOP.match(line) if level == "error" else None
            if stop is not None:
                level = "info" if stop.group(1) == b": stopping" else "warning"
            record.update(level=level, line=line.decode(errors="replace"))
        record.update(self._fields)
        record["logger"] = "native"
        record["timestamp"] = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        return jsonlib.dumps(record).encode() + b"\n"

    def close(self, timeout_s: float = 1.0) -> None:
        """Put the original fds back and forward what is still in the pipes."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, original, _ in self._streams:
            os.dup2(original, fd)
        os.write(self._wake_write, b"x")  # never read: every pump sees it
        for _, _, thread in self._streams:
            thread.join(timeout_s)
        self._streams.clear()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return  # the reader of our output is gone; nothing better to do with the line
        view = view[written:]


_capture: _NativeCapture | None = None


def capture_native_output(process: str | None = None) -> bool:
    """In a service process logging JSON: route fds 1 and 2 through `_NativeCapture` so native
    libraries' lines (Mooncake, absl, glog) and plain prints become JSON records too.

    A no-op (False) when the log is for a terminal (console format) or KVRELAY_NATIVE_CAPTURE=0.
    Call once, after configure_logging(); `flush_native_output()` before an `os._exit`.
    """
    global _capture
    if _capture is not None:
        return True
    if not _json_logging or os.environ.get("KVRELAY_NATIVE_CAPTURE", "1") == "0":
        return False
    fields: dict[str, Any] = {"pid": os.getpid()}
    if process:
        fields["process"] = process
    _capture = _NativeCapture(fields)
    atexit.register(flush_native_output)
    return True


def flush_native_output() -> None:
    global _capture
    capture, _capture = _capture, None
    if capture is not None:
        capture.close()


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


# A request that does not decode is answered before any credential is checked, so any peer can
# send them as fast as it likes: its `malformed_request` line is written once per method per this
# many seconds, the next one saying how many were left out (`suppressed`). Found black-box: 3000
# junk Heartbeat requests from an anonymous peer wrote 1997 warning lines to the broker's log in
# 3 s (a loop of them fills the disk under the log). Methods are the server's own (an unknown one
# never reaches a handler), so the table is bounded by them.
MALFORMED_LOG_WINDOW_S = 60.0


class _MalformedLog:
    """One `malformed_request` line per method per MALFORMED_LOG_WINDOW_S, for one server."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = MALFORMED_LOG_WINDOW_S) -> None:
        self._clock = clock
        self._window_s = window_s
        self._lock = threading.Lock()
        # method -> (time of the last line written, lines left out since)
        self._last: dict[str, tuple[float, int]] = {}

    def admit(self, method: str) -> int | None:
        """None: leave this line out (it is counted); else write it, with the number left out."""
        now = self._clock()
        with self._lock:
            last = self._last.get(method)
            if last is not None and now - last[0] < self._window_s:
                self._last[method] = (last[0], last[1] + 1)
                return None
            self._last[method] = (now, 0)
            return 0 if last is None else last[1]

    async def reject(self, method: str, request: _Malformed, context: Any) -> None:
        import grpc

        suppressed = self.admit(method)
        if suppressed is not None:
            get_logger(__name__).warning(
                "malformed_request", method=method, suppressed=suppressed,
                error=f"{type(request.error).__name__}: {request.error}"[:200],
            )  # fmt: skip
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the {method} request message could not be decoded")

    async def checked_stream(self, method: str, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for item in requests:
            if isinstance(item, _Malformed):
                await self.reject(method, item, context)
            yield item

    @asynccontextmanager
    async def bind_call(self, method: str, request: Any, context: Any) -> AsyncIterator[None]:
        if isinstance(request, _Malformed):
            await self.reject(method, request, context)
        ids = _ids_from_request(None if hasattr(request, "__aiter__") else request, context.invocation_metadata())
        with bind_request(**ids):
            yield


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


def logging_interceptor() -> Any:
    """A grpc.aio server interceptor binding request_id/ticket_id (from the request message or
    metadata) to every log line a handler writes, and answering a request that cannot be decoded
    with INVALID_ARGUMENT and a warning line (not grpc's UNKNOWN and a traceback), at most one per
    method per MALFORMED_LOG_WINDOW_S."""
    import grpc

    malformed = _MalformedLog()

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
                        handler = handler._replace(**{kind: _checking_requests(behavior, method, malformed)})
            return wrap_handler(handler, method, malformed.bind_call)

    return _Interceptor()


def _checking_requests(behavior: Callable[..., Any], method: str, malformed: _MalformedLog) -> Callable[..., Any]:
    # Client-streaming handlers get their requests through an iterator: a malformed message in
    # the middle of the stream ends the call the same way.
    if inspect.isasyncgenfunction(behavior):

        async def stream_wrapper(requests: Any, context: Any) -> AsyncIterator[Any]:
            async for item in behavior(malformed.checked_stream(method, requests, context), context):
                yield item

        return stream_wrapper

    async def wrapper(requests: Any, context: Any) -> Any:
        return await behavior(malformed.checked_stream(method, requests, context), context)

    return wrapper
