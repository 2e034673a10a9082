"""The bounds of a generation request, in one place: the broker enforces them (INVALID_ARGUMENT
naming the field, broker/generation.py) and the client SDK checks the same ones, with the same
message, before it sends, so a value is refused alike whichever side sees it first.

Pure standard library: the client SDK imports it. Bounds that depend on the deployment (the AR's
max tokens, the largest image a DiT model draws) stay with the broker.
"""

from __future__ import annotations

import re
from typing import Final

MAX_REQUEST_ID_LENGTH: Final = 128
REQUEST_ID_CHARS: Final = "A-Za-z0-9._:~-"
_REQUEST_ID: Final = re.compile(f"[{REQUEST_ID_CHARS}]+")
# How much of a refused id a message quotes: enough to recognise it, never a wall of text.
QUOTED_ID_CHARS: Final = 40


def request_id_problem(request_id: str) -> str | None:
    """Why `request_id` is not a valid generation id (without the field name), or None."""
    if len(request_id) <= MAX_REQUEST_ID_LENGTH and _REQUEST_ID.fullmatch(request_id):
        return None
    bound = f"at most {MAX_REQUEST_ID_LENGTH} characters of [{REQUEST_ID_CHARS}]"
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        return f"{bound}, got {len(request_id)} characters: {request_id[:QUOTED_ID_CHARS]!r}..."
    return f"{bound}, got {request_id[:QUOTED_ID_CHARS]!r}"
