"""pytest must be able to format a failure while grpc objects are being finalized.

CPython 3.11.7: a garbage collection inside ast.parse may run a finalizer that raises; the
unraisable hook formats its traceback, which parses source again (3.11's caret anchors), and the
outer parse fails with "SystemError: AST constructor recursion depth mismatch". pytest, parsing a
test's source to show a failure, crashed a whole run that way (INTERNALERROR: every later test
unrun). tests/conftest.py runs no collection inside ast.parse.
"""

from __future__ import annotations

import ast
import gc
import sys
import traceback
from typing import Any

import pytest


class _RaisesWhenFinalized:
    def __del__(self) -> None:
        table = {"a": 1}
        _ = table["a"] + table["b"]  # KeyError inside an expression: 3.11 parses it for carets


def test_a_parse_survives_a_finalizer_that_raises_during_it(monkeypatch: pytest.MonkeyPatch) -> None:
    formatted: list[str] = []

    def hook(unraisable: Any) -> None:  # what pytest's unraisableexception plugin does
        formatted.extend(traceback.format_exception(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))

    monkeypatch.setattr(sys, "unraisablehook", hook)
    source = open(ast.__file__).read() * 3
    thresholds = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    try:
        for _ in range(10):
            for _ in range(200):
                cycle = _RaisesWhenFinalized()
                cycle.self = cycle  # type: ignore[attr-defined]
            del cycle
            ast.parse(source)
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    assert any("KeyError" in line for line in formatted)  # the finalizers did run and raise
