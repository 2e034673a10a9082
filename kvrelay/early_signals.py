"""Stop signals a service process (`kvrelay broker`, `ar`, `dit`) gets before it can act on them:
while Python imports its modules, reads its config and starts listening. They are recorded and
handed to the process's `kvrelay.stopping.ProcessStop` when it takes the signals over, as if they
had come right then (a first one a graceful stop, a second one a fast stop).

Before, SIGTERM in that first second killed the process by the signal's default action (exit -15,
nothing logged) where docs/operations.md promises a clean stop in every phase; found black-box
stopping `kvrelay up` while its children started. Left: the few milliseconds before this module
runs (the interpreter's own start), where no Python handler can exist yet.

Imports nothing but `signal`: it runs first, from `python -m kvrelay` and the `kvrelay` command.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from types import FrameType

SERVICE_COMMANDS = ("broker", "ar", "dit")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_caught: list[str] = []


def _record(signum: int, frame: FrameType | None) -> None:
    _caught.append(signal.Signals(signum).name)


def catch(argv: Sequence[str]) -> None:
    """Record the stop signals of a service process from now on (argv: `kvrelay <command> ...`)."""
    if len(argv) > 1 and argv[1] in SERVICE_COMMANDS:
        for sig in SIGNALS:
            signal.signal(sig, _record)


def take() -> list[str]:
    """The signals recorded so far, in order (names, e.g. "SIGTERM"); forgets them."""
    names = list(_caught)
    _caught.clear()
    return names
