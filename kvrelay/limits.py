"""The bounds of a generation request, in one place: the broker enforces them (INVALID_ARGUMENT
naming the field, broker/generation.py) and the client SDK checks the same ones, with the same
message, before it sends, so a value is refused alike whichever side sees it first.

Pure standard library: the client SDK imports it. Bounds that depend on the deployment (the AR's
max tokens, the largest image a DiT model draws) stay with the broker.
"""

from __future__ import annotations

import math
import re
from typing import Final

MAX_REQUEST_ID_LENGTH: Final = 128
REQUEST_ID_CHARS: Final = "A-Za-z0-9._:~-"
_REQUEST_ID: Final = re.compile(f"[{REQUEST_ID_CHARS}]+")
MIN_SIDE: Final = 64
MAX_SIDE: Final = 2048
SIDE_MULTIPLE: Final = 16
MIN_STEPS: Final = 1
MAX_STEPS: Final = 1000
MIN_GUIDANCE: Final = 1.0  # 1.0 = no CFG
# The UTF-8 bytes of `prompt` and of `negative_prompt`, each.
MAX_PROMPT_BYTES: Final = 1 << 20
# ListGenerations: `page_size` 0 asks for this many; more than the max is the max.
DEFAULT_LIST_PAGE_SIZE: Final = 100
MAX_LIST_PAGE_SIZE: Final = 1000
# The wire's uint64, all of which every consumer takes (torch generators: up to 2**64 - 1).
SEED_BITS: Final = 64
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


def side_problem(side: int) -> str | None:
    """Why `side` is not a valid width or height, or None (the largest image a deployment's DiT
    model draws may be smaller: the broker checks that, IMAGE_TOO_LARGE)."""
    if MIN_SIDE <= side <= MAX_SIDE and side % SIDE_MULTIPLE == 0:
        return None
    return f"must be a multiple of {SIDE_MULTIPLE} in [{MIN_SIDE}, {MAX_SIDE}], got {side}"


def steps_problem(steps: int) -> str | None:
    """Why `steps` is not a valid num_inference_steps, or None."""
    if MIN_STEPS <= steps <= MAX_STEPS:
        return None
    return f"must be in [{MIN_STEPS}, {MAX_STEPS}], got {steps}"


def guidance_problem(guidance: float) -> str | None:
    """Why `guidance` is not a valid guidance_scale, or None."""
    if math.isfinite(guidance) and guidance >= MIN_GUIDANCE:
        return None
    return f"must be finite and >= {MIN_GUIDANCE} ({MIN_GUIDANCE} = no CFG), got {guidance}"


def seed_problem(seed: int) -> str | None:
    """Why `seed` is not a valid seed, or None (the broker's own draw stays below 2**63)."""
    if 0 <= seed < 1 << SEED_BITS:
        return None
    return f"must be in [0, 2**{SEED_BITS}), got {seed}"
