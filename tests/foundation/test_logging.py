"""Logging: ids bound through contextvars, robust to grpc finalising handlers elsewhere."""

from __future__ import annotations


def test_bind_request_tolerates_a_reset_from_another_context() -> None:
    import contextvars

    import structlog

    from kvrelay.logging import bind_request

    # A stream handler's generator can be finalised from another context (grpc cancels it).
    gen_ctx = contextvars.copy_context()
    cm = bind_request(request_id="r-1")
    gen_ctx.run(cm.__enter__)
    cm.__exit__(None, None, None)  # in this context: must not raise
    assert "request_id" not in structlog.contextvars.get_contextvars()
