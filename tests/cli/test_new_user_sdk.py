"""The SDK as a new user met it, black-box: a timeout that can never be met (zero, negative, NaN)
or that gRPC cannot hold (1e10 s: a deadline past 2262) came back from every call as
DEADLINE_EXCEEDED "Deadline Exceeded", as if the broker were slow."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrelay.client import AsyncKvRelayClient, GenerationState, KvRelayClient, KvRelayError, TicketState
from tests.client.harness import Harness, ServerThread

BAD = [0, -1, -0.5, math.nan, math.inf, 1e10]


def _assert_timeout_refused(err: KvRelayError, value: float) -> None:
    assert (err.code, err.reason, err.details) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT", {"field": "timeout"})
    assert err.message == (
        f"timeout: must be a positive number of seconds, at most 1e+09 (None: the default), got {value}"
    )


@pytest.fixture
def server() -> Iterator[ServerThread]:
    thread = ServerThread(Harness()).start()
    try:
        yield thread
    finally:
        thread.stop()


@pytest.mark.parametrize("value", BAD)
def test_a_timeout_that_can_never_be_met_is_refused_by_the_blocking_client(server: ServerThread, value: float) -> None:
    with pytest.raises(KvRelayError) as err:
        KvRelayClient(server.address, timeout=value)
    _assert_timeout_refused(err.value, value)
    with KvRelayClient(server.address) as client:
        with pytest.raises(KvRelayError) as err:
            client.generate("a fox", width=64, height=64, timeout=value)
        _assert_timeout_refused(err.value, value)
        with pytest.raises(KvRelayError) as err:
            client.list_generations(timeout=value)
        _assert_timeout_refused(err.value, value)
        # None is the default, and a positive timeout still works, the longest one included.
        assert client.generate("a fox", width=64, height=64, timeout=None).result().width == 64
        assert client.generate("a fox", width=64, height=64, timeout=1e9).result().width == 64
        assert client.list_generations(timeout=5) is not None


@pytest.mark.parametrize("value", [0, -1, math.nan, 1e10])
def test_a_timeout_that_can_never_be_met_is_refused_by_the_asyncio_client(server: ServerThread, value: float) -> None:
    async def body() -> None:
        async with AsyncKvRelayClient(server.address) as client:
            with pytest.raises(KvRelayError) as err:
                await client.generate("a fox", width=64, height=64, timeout=value)
            _assert_timeout_refused(err.value, value)
            with pytest.raises(KvRelayError) as err:
                await client.get_generation("nope", timeout=value)
            _assert_timeout_refused(err.value, value)

    asyncio.run(body())


# --- text that is not UTF-8 ----------------------------------------------------------------------
# Bytes that are not UTF-8 on the command line (or piped in) reach Python as lone surrogates
# ("\udcff"): `kvrelay generate $'\xff\xfe'` printed a UnicodeEncodeError traceback from protobuf,
# and so did the SDK's generate/get/cancel with such a string (found black-box).


def _assert_not_utf8(err: KvRelayError, field: str) -> None:
    assert (err.code, err.reason, err.details) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT", {"field": field})
    assert err.message == f"{field}: not UTF-8 text (byte 0xff at character 1)"


def test_text_that_is_not_utf8_is_refused_naming_the_field(server: ServerThread) -> None:
    bad = "a\udcff"
    with KvRelayClient(server.address) as client:
        for kwargs, field in (({"prompt": bad}, "prompt"), ({"prompt": "a fox", "negative_prompt": bad}, "negative_prompt"),
                              ({"prompt": "a fox", "request_id": bad}, "request_id")):
            with pytest.raises(KvRelayError) as err:
                client.generate(width=64, height=64, **kwargs)  # type: ignore[arg-type]
            _assert_not_utf8(err.value, field)
        for call, field in ((client.get_generation, "request_id"), (client.cancel_generation, "request_id"),
                            (client.get_pools, "replica_id"), (lambda v: client.list_tickets(replica_id=v), "replica_id")):
            with pytest.raises(KvRelayError) as err:
                call(bad)
            _assert_not_utf8(err.value, field)
        # Any Unicode text still goes (and a non-str stays the caller's TypeError).
        assert client.generate("un renard \u00e9 \U0001f98a", width=64, height=64).result().width == 64
        with pytest.raises(TypeError):
            client.get_generation(7)  # type: ignore[arg-type]

    async def body() -> None:
        async with AsyncKvRelayClient(server.address) as client:
            with pytest.raises(KvRelayError) as err:
                await client.generate(bad, width=64, height=64)
            _assert_not_utf8(err.value, "prompt")

    asyncio.run(body())


def test_the_cli_says_a_prompt_is_not_utf8_in_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVRELAY_LOG_FORMAT": "console", "KVRELAY_NATIVE_CAPTURE": "0"}
    env.pop("KVRELAY_CONFIG", None)
    # Refused before any call: nothing needs to listen at the target.
    argv = [sys.executable, "-m", "kvrelay", "generate", "--target", "127.0.0.1:1", "-o", str(tmp_path / "x.png")]
    done = subprocess.run([*argv, b"a\xff"], capture_output=True, text=True, timeout=60, env=env)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[0] == "kvrelay generate: INVALID_ARGUMENT: prompt: not UTF-8 text (byte 0xff at character 1)"
    # A strict stdin (a UTF-8 locale) fails to decode; a C locale's surrogateescape one reaches
    # the SDK's check (the argument's case above).
    piped = subprocess.run([*argv, "-"], input=b"a\xff", capture_output=True, timeout=60,
                           env={**env, "PYTHONIOENCODING": "utf-8:strict"})
    assert piped.returncode == 2, piped.stderr
    assert piped.stderr.decode().strip() == (
        "kvrelay generate: the prompt from stdin: not UTF-8 text (byte 0xff at offset 1)"
    )
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"ab\xffcd")
    done = subprocess.run([*argv, "--prompt-file", str(prompt)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"kvrelay generate: --prompt-file {prompt}: not UTF-8 text (byte 0xff at offset 2)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_inference_steps": 2.7}, "num_inference_steps must be an integer, not float 2.7"),
        ({"seed": 1.5}, "seed must be an integer, not float 1.5"),
        ({"width": "512"}, "width must be an integer, not str '512'"),
        ({"guidance_scale": "2"}, "guidance_scale must be a number, not str '2'"),
    ],
)
def test_a_number_of_the_wrong_kind_is_the_callers_type_error(
    server: ServerThread, kwargs: dict[str, object], message: str
) -> None:
    # They were taken as int(2.7) = 2 steps, seed 1, width 512 and guidance 2.0 without a word.
    with KvRelayClient(server.address) as client:
        with pytest.raises(TypeError) as err:
            client.generate("a fox", **{"width": 64, "height": 64, **kwargs})  # type: ignore[arg-type]
        assert str(err.value) == message
        with pytest.raises(TypeError, match="page_size must be an integer"):
            client.list_generations(page_size=1.0)  # type: ignore[arg-type]
        # Integers of any kind (bool is one to Python) and floats for the scale still go.
        assert client.generate("a fox", width=64, height=64, seed=7, guidance_scale=2).result().seed == 7


def test_text_of_the_wrong_kind_is_the_callers_type_error_naming_the_argument(server: ServerThread) -> None:
    # Found black-box: request_id=5 / get_generation(5) raised protobuf's "bad argument type for
    # built-in operation", get_generation(None) asked for the generation '' (NOT_FOUND), and
    # list_generations(states="QUEUED") "invalid literal for int() with base 10: 'Q'".
    with KvRelayClient(server.address) as client:
        for call, message in (
            (lambda: client.generate("a fox", request_id=5), "request_id must be str, not int 5"),
            (lambda: client.generate("a fox", negative_prompt=b"x"), "negative_prompt must be str, not bytes b'x'"),
            (lambda: client.get_generation(5), "request_id must be str, not int 5"),
            (lambda: client.get_generation(None), "request_id must be str, not NoneType None"),
            (lambda: client.cancel_generation(5.0), "request_id must be str, not float 5.0"),
            (lambda: client.get_pools(replica_id=3), "replica_id must be str, not int 3"),
            (lambda: client.list_generations(states="QUEUED"),
             "states must be an iterable of GenerationState, not str 'QUEUED'"),
            (lambda: client.list_tickets(states=TicketState.WRITING),
             "states must be an iterable of TicketState, not TicketState <TicketState.WRITING: 2>"),
        ):
            with pytest.raises(TypeError) as err:
                call()  # type: ignore[no-untyped-call]
            assert str(err.value) == message
        # A list of states, or any iterable of them, still goes.
        assert isinstance(client.list_generations(states=(GenerationState.QUEUED,)), list)
    # The client's own target and token ('int' object has no attribute 'strip').
    for make, message in (
        (lambda: KvRelayClient(5), "target must be str, not int 5"),
        (lambda: KvRelayClient(None), "target must be str, not NoneType None"),
        (lambda: KvRelayClient(server.address, token=5), "token must be str or None, not int 5"),
        (lambda: AsyncKvRelayClient(b"127.0.0.1:1"), "target must be str, not bytes b'127.0.0.1:1'"),
    ):
        with pytest.raises(TypeError) as err:
            make()  # type: ignore[no-untyped-call]
        assert str(err.value) == message


# --- tokens ----------------------------------------------------------------------------------------
# A token with a trailing newline (read from a file) or a non-ASCII character made gRPC raise
# ValueError "metadata was invalid" from every call: a traceback from `kvrelay generate` and
# `kvrelay cancel` (found black-box with KVRELAY_API_TOKEN=$'abc\n' and --token tøken).


def test_a_token_keeps_no_surrounding_whitespace_and_must_be_printable_ascii() -> None:
    harness = Harness()
    harness.token = "tok"
    server = ServerThread(harness).start()
    try:
        # The servers strip their own token files and variables; the SDK strips what it sends.
        with KvRelayClient(server.address, token="tok\r\n") as client:
            assert client.generate("a fox", width=64, height=64).result().width == 64
        for bad, shown in (("t\u00f8ken", "'\\xf8' at character 1"), ("a\x01b", "'\\x01' at character 1")):
            with pytest.raises(KvRelayError) as err:
                KvRelayClient(server.address, token=bad)
            assert (err.value.code, err.value.details) == ("INVALID_ARGUMENT", {"field": "token"})
            assert err.value.message == f"token: {shown} is not printable ASCII, which a bearer token is"
            with pytest.raises(KvRelayError):
                AsyncKvRelayClient(server.address, token=bad)
    finally:
        server.stop()


@pytest.mark.parametrize("argv", [["generate", "a fox", "-q"], ["cancel", "some-id"]])
def test_the_cli_says_a_bad_token_in_one_line(tmp_path: Path, argv: list[str]) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVRELAY_API_TOKEN": "t\u00f8ken", "KVRELAY_LOG_FORMAT": "console"}
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay", *argv, "--target", "127.0.0.1:1"], capture_output=True, text=True,
        timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"kvrelay {argv[0]}: INVALID_ARGUMENT: token: '\\xf8' at character 1 is not printable ASCII, which a bearer token is",
        "  field: token",
    ]
