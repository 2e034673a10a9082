"""The bounds of a generation request, in one place: the broker enforces them (INVALID_ARGUMENT
naming the field, broker/generation.py) and the client SDK checks the same ones, with the same
message, before it sends, so a value is refused alike whichever side sees it first. And the bound
of every small file a setting or a flag names (tokens, the replica secret, TLS PEM files, the
config, a checkpoint's JSON and tokenizer files): `read_bounded_file` is the one reader of them,
`check_bounded_file` the check of those a library opens itself.

Pure standard library: the client SDK imports it. Bounds that depend on the deployment (the AR's
max tokens, the largest image a DiT model draws) stay with the broker.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any, Final

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
# ListGenerations counts against its caller's rate-limit bucket (security.rate_limit_per_second)
# as one request plus one per this many generations its page may hold: a page of 1000 is 101,
# the default page (100) 11. Each listed generation costs the broker a few microseconds of its
# event loop: at rate_limit_per_second 2000 one caller lists at most ~20,000 a second.
LIST_GENERATIONS_PER_REQUEST: Final = 10
# ...and, once its reply is built, one more per this many bytes the reply carries, taken from the
# same bucket after the fact (it may run into debt: the next call waits until it is paid). Bytes
# are most of a listing's cost where prompts are retained (up to 1 MiB each): an operator's 4 MiB
# reply holds the loop ~10-20 ms, and a flood of them within the page count (~20 calls/s) held
# a Heartbeat 240-450 ms at p99 (benchmarks/list_flood.py). 4 MiB counts 1024 more: at
# rate_limit_per_second 2000 one caller receives ~8 MiB of listings a second; a public caller's
# redacted page (~100 bytes a generation) counts ~25 more for 1000.
LIST_REPLY_BYTES_PER_REQUEST: Final = 4096
# The wire's uint64, all of which every consumer takes (torch generators: up to 2**64 - 1).
SEED_BITS: Final = 64
# How much of a refused id a message quotes: enough to recognise it, never a wall of text.
QUOTED_ID_CHARS: Final = 40


def list_page_size(requested: int) -> int:
    """The generations a ListGenerations page holds at most: 0 is the default, above the maximum
    is the maximum (AIP-158)."""
    return min(requested or DEFAULT_LIST_PAGE_SIZE, MAX_LIST_PAGE_SIZE)


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


# Files a setting or a flag names and a process reads whole, at start. Found black-box: a TLS file
# or a token file pointing at /dev/zero was read until MemoryError (without a memory limit, the
# machine's memory), and a pipe blocked the start or was read empty.
# A token or the replica secret (64 hex characters when made as documented).
MAX_SECRET_FILE_BYTES: Final = 64 << 10
# A certificate chain, a private key or a CA bundle (a system's whole bundle is about 220 KiB).
MAX_PEM_FILE_BYTES: Final = 4 << 20
# A YAML config (the shipped ones are a few KiB).
MAX_CONFIG_FILE_BYTES: Final = 4 << 20
# A `kvrelay bench --dataset` JSONL file of prompts (the shipped one is a few KiB).
MAX_DATASET_FILE_BYTES: Final = 64 << 20
# A JSON file of a model checkpoint (config.json, a weight index, tokenizer.json: a Qwen2
# tokenizer.json is about 7 MiB).
MAX_MODEL_JSON_BYTES: Final = 64 << 20
# A file of a Hugging Face tokenizer (tokenizer.json, a SentencePiece model, a vocabulary, its
# tokenizer_config.json) that kvrelay reads or hands to `tokenizers`/`transformers`: the largest
# released are tens of MiB (a Gemma tokenizer.json is about 33 MiB).
MAX_TOKENIZER_FILE_BYTES: Final = 256 << 20
# How much of the end of a log file `kvrelay up` reads for a child's last lines: its logs are
# appended to across restarts and grow for as long as the node runs.
LOG_TAIL_BYTES: Final = 256 << 10


class FileRefused(ValueError):
    """A file `read_bounded_file` would not read. The message follows the path, e.g.
    `f"{flag} {path}: {err}"`: "not a regular file (a pipe or a device): give a PEM file"."""


def _size_text(size: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} bytes"


def _refusal(st: os.stat_result, max_bytes: int, what: str) -> FileRefused | None:
    if stat.S_ISDIR(st.st_mode):
        return FileRefused(f"a folder, not a file: give a {what}")
    if not stat.S_ISREG(st.st_mode):
        # A device or a pipe has no size to check and may never end (/dev/zero, /dev/urandom).
        return FileRefused(f"not a regular file (a pipe or a device): give a {what}")
    if st.st_size > max_bytes:
        return FileRefused(f"{st.st_size} bytes: more than a {what} may be ({_size_text(max_bytes)})")
    return None


def read_bounded_file(path: str | os.PathLike[str], max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file at `path`, refused (FileRefused) when it is no regular file
    (a folder, a device, a pipe) or holds more than `max_bytes`; never more than `max_bytes + 1`
    bytes are read, so a file that grows while read is refused too. `what` names what the file
    should be in the message ("PEM file"). OSError (missing, unreadable) passes through.

    Opened non-blocking: a FIFO's open would otherwise wait for a writer forever."""
    refused = _refusal(os.stat(path), max_bytes, what)
    if refused is not None:
        raise refused
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        # What was opened, not what the path named a moment ago (it may have been replaced).
        refused = _refusal(os.fstat(fd), max_bytes, what)
        if refused is not None:
            raise refused
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise FileRefused(f"more than a {what} may be ({_size_text(max_bytes)}): it grew while read")
    return data


def check_bounded_file(path: str | os.PathLike[str], max_bytes: int, what: str) -> None:
    """Refuse (FileRefused) the file at `path` as `read_bounded_file` would, without reading it:
    for a file a library opens by its path (`transformers` reads a tokenizer's files itself).
    OSError (missing, unreadable) passes through. The library reads what the path names then:
    `read_bounded_file` is the reader where kvrelay can hand the bytes over instead."""
    refused = _refusal(os.stat(path), max_bytes, what)
    if refused is not None:
        raise refused


def read_json_file(path: str | os.PathLike[str], max_bytes: int = MAX_MODEL_JSON_BYTES) -> Any:
    """The JSON of the regular file at `path`, read with `read_bounded_file`'s bound; its
    FileRefused names the path ("PATH: 70000000 bytes: more than a JSON file may be (64 MiB)")."""
    try:
        data = read_bounded_file(path, max_bytes, "JSON file")
    except FileRefused as err:
        raise FileRefused(f"{os.fspath(path)}: {err}") from None
    try:
        return json.loads(data)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError: neither names the file
        raise ValueError(f"{os.fspath(path)}: not valid JSON ({err})") from None


def read_file_tail(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """At most the last `max_bytes` bytes of the file at `path`, from the start of a line (the
    partial first line of a cut is dropped). OSError passes through."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = max(0, size - max_bytes)
        f.seek(start)
        data = f.read(max_bytes)
    if start > 0:
        newline = data.find(b"\n")
        data = data[newline + 1 :] if newline >= 0 else b""
    return data
