"""`kvrelay generate` and `kvrelay status` against the real gRPC harness server."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from google.protobuf import timestamp_pb2
from PIL import Image

from kvrelay.client.cli import run_generate, run_status
from kvrelay.v1 import broker_pb2, common_pb2, generation_pb2
from tests.client.harness import Gen, Harness, ServerThread

REPO = Path(__file__).resolve().parents[2]
PB = generation_pb2.GenerationState


def generate_args(target: str, output: Path, **overrides: object) -> argparse.Namespace:
    values: dict[str, object] = dict(
        prompt="a red fox",
        negative_prompt="",
        seed=5,
        width=64,
        height=80,
        steps=3,
        guidance_scale=2.0,
        output=str(output),
        target=target,
        request_id=None,
        timeout=None,
        token=None,
        quiet=False,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def test_generate_writes_the_png_and_prints_where_and_the_timings(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "images" / "fox.png"
    assert run_generate(generate_args(server.address, output)) == 0
    assert Image.open(output).size == (64, 80)
    out, err = capsys.readouterr()
    assert f"wrote {output} (64x80, seed 5" in out
    assert "timings: queue" in out and "total" in out
    # Not a terminal here: one plain line per stage and step, in order.
    lines = [line.split("] ", 1)[1] for line in err.splitlines() if "] " in line]
    assert lines == [
        "QUEUED",
        "PREFILLING",
        "TRANSFERRING",
        "DENOISING 1/3",
        "DENOISING 2/3",
        "DENOISING 3/3",
        "SUCCEEDED",
    ]


def test_generate_quiet_prints_only_the_path(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_generate(generate_args(server.address, tmp_path / "q.png", quiet=True)) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("wrote ") and "timings" not in out


def test_generate_errors_print_code_reason_message_and_exit_1(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "bad.png"
    assert run_generate(generate_args(server.address, output, width=100)) == 1
    err = capsys.readouterr().err
    assert "kvrelay generate: INVALID_ARGUMENT: width: must be a multiple of 16" in err
    assert "field: width" in err
    assert not output.exists()
    assert (
        run_generate(generate_args(server.address, output, prompt="fail:TRANSFER_TIMEOUT", quiet=True)) == 1
    )
    assert "DEADLINE_EXCEEDED (TRANSFER_TIMEOUT)" in capsys.readouterr().err
    assert run_generate(generate_args("127.0.0.1:1", output, quiet=True)) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_an_error_message_with_terminal_controls_is_printed_escaped(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The error line carries the server's words and a replica's it relays: ESC ] 0 ; ... BEL in a
    failure message would retitle the terminal, ESC [ 2 J clear it (found red-teaming; the tables
    escaped them already)."""
    prompt = "fail:TRANSFER_FAILED|rank 0: \x1b]0;pwned\x07\x1b[2Jgone\u202e"
    output = tmp_path / "out.png"
    assert run_generate(generate_args(server.address, output, prompt=prompt, quiet=True)) == 1
    err = capsys.readouterr().err
    assert "DEADLINE_EXCEEDED (TRANSFER_FAILED): rank 0: \\x1b]0;pwned\\x07\\x1b[2Jgone\\u202e" in err, err
    assert all(c.isprintable() or c == "\n" for c in err), repr(err)


def interrupt_when_denoising(server: ServerThread, prefix: list[str], request_id: str, output: str) -> tuple[int, str]:
    """Run ``prefix + generate ...`` (500 slow steps), Ctrl-C it once the server denoises, and
    return its exit code and its stdout + stderr."""
    argv = prefix + ["generate", "slow", "--steps", "500", "--width", "64", "--height", "64"]
    argv += ["--target", server.address, "--request-id", request_id, "-o", output]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        server.wait_for_state(request_id, PB.GENERATION_STATE_DENOISING, timeout=60)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out + err


def test_ctrl_c_cancels_on_the_server_and_exits_130(
    server: ServerThread, harness: Harness, tmp_path: Path
) -> None:
    harness.step_delay = 0.1
    output = tmp_path / "never.png"
    code, text = interrupt_when_denoising(server, [sys.executable, "-m", "kvrelay"], "ctrl-c", str(output))
    assert code == 130, text
    assert "cancelling request ctrl-c" in text
    generation = server.wait_for_state("ctrl-c", PB.GENERATION_STATE_CANCELLED)
    assert harness.generations["ctrl-c"].cancelled_by == "CancelGeneration"
    assert generation.step < 500
    assert not output.exists()


# Run by the test below in a child process: `kvrelay generate` whose event iteration swallows
# KeyboardInterrupt, as a library's except-all or a finalizer does.
SWALLOWING_CLIENT = """
import queue, sys, threading
from kvrelay.client.sync import GenerationHandle
from kvrelay.node.cli import main

original = GenerationHandle.events

def swallowing_events(self):
    items = queue.Queue()
    def pump():
        for event in original(self):
            items.put(event)
        items.put(None)
    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            event = items.get(timeout=0.05)
        except queue.Empty:
            continue
        except KeyboardInterrupt:
            print("swallowed", file=sys.stderr, flush=True)
            continue
        if event is None:
            return
        yield event

GenerationHandle.events = swallowing_events
raise SystemExit(main(sys.argv[1:]))
"""


def test_ctrl_c_cancels_even_when_the_keyboard_interrupt_is_swallowed(server: ServerThread, harness: Harness) -> None:
    harness.step_delay = 0.1
    code, text = interrupt_when_denoising(server, [sys.executable, "-c", SWALLOWING_CLIENT], "swallowed", os.devnull)
    assert "swallowed" in text and code == 130, text
    assert "cancelling request swallowed" in text
    server.wait_for_state("swallowed", PB.GENERATION_STATE_CANCELLED)
    assert harness.generations["swallowed"].cancelled_by == "CancelGeneration"


def _fill_status(harness: Harness) -> None:
    harness.replicas = [
        broker_pb2.ReplicaInfo(
            replica_id="ar-0",
            role=common_pb2.REPLICA_ROLE_AR,
            endpoint="127.0.0.1:50061",
            incarnation_id="aaaa1111",
        ),
        broker_pb2.ReplicaInfo(
            replica_id="dit-0",
            role=common_pb2.REPLICA_ROLE_DIT,
            endpoint="127.0.0.1:50071",
            incarnation_id="bbbb2222",
            parallelism=common_pb2.Parallelism(tensor_parallel_size=2, sequence_parallel_size=1),
            transport=common_pb2.TRANSPORT_KIND_MOONCAKE,
            up=True,
            fenced=True,
        ),
    ]
    harness.pools = [
        broker_pb2.PoolStatus(
            replica_id="dit-0", total_pages=64, free_pages=60, reserved_pages=3, draining_pages=1, up=True,
            available_pages=60,
        )
    ]
    harness.tickets = [
        broker_pb2.Ticket(
            ticket_id="tk-1",
            request_id="req-1",
            state=broker_pb2.TICKET_STATE_WRITING,
            ar_replica_id="ar-0",
            dit_replica_id="dit-0",
            rows=[
                common_pb2.RowPages(row=0, num_tokens=30, page_ids=[0, 1]),
                common_pb2.RowPages(row=1, page_ids=[2]),
            ],
            writes=[
                broker_pb2.WriteProgress(row=0, status=common_pb2.WRITE_STATUS_OK),
                broker_pb2.WriteProgress(row=1),
            ],
            sequence=1,
        ),
        broker_pb2.Ticket(
            ticket_id="tk-2",
            request_id="req-2",
            state=broker_pb2.TICKET_STATE_DRAINING,
            ar_replica_id="ar-0",
            dit_replica_id="dit-0",
            rows=[common_pb2.RowPages(row=0, num_tokens=20, page_ids=[5, 6, 7, 9])],
            writes=[broker_pb2.WriteProgress(row=0, src_rank=1, status=common_pb2.WRITE_STATUS_IN_DOUBT)],
            sequence=2,
        ),
    ]


def test_status_prints_replicas_pools_and_tickets_as_tables(
    server: ServerThread, harness: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    _fill_status(harness)
    assert run_status(argparse.Namespace(target=server.address, json=False, token=None)) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("REPLICA "))
    assert header.split() == [
        "REPLICA",
        "ROLE",
        "ENDPOINT",
        "PARALLEL",
        "TRANSPORT",
        "UP",
        "FENCED",
        "LEASE",
        "INCARNATION",
    ]
    dit_row = next(line for line in lines if line.startswith("dit-0 "))
    assert dit_row.split()[:7] == ["dit-0", "dit", "127.0.0.1:50071", "tp2", "mooncake", "yes", "FENCED"]
    pool_row = next(line for line in lines if line.startswith("dit-0") and "64" in line)
    assert pool_row.split()[:6] == ["dit-0", "up", "64", "60", "3", "1"]
    ticket_row = next(line for line in lines if line.startswith("tk-1"))
    assert ticket_row.split()[:10] == ["tk-1", "req-1", "WRITING", "-", "ar-0", "dit-0", "3", "1/2", "0", "0/0"]
    # An in-doubt write is not counted as written, and is listed with the pages it holds.
    drain_row = next(line for line in lines if line.startswith("tk-2 "))
    assert drain_row.split()[:10] == ["tk-2", "req-2", "DRAINING", "-", "ar-0", "dit-0", "4", "0/1", "1", "0/0"]
    doubt_row = next(line for line in lines if line.startswith("tk-2") and "5-7,9" in line)
    assert doubt_row.split()[:8] == ["tk-2", "DRAINING", "dit-0", "0", "1", "0", "ar-0", "5-7,9"]


def test_status_says_deregistered_for_a_replica_down_with_its_lease_running(
    server: ServerThread, harness: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found black-box: a deregistered replica that still heartbeats (its own stop finishing its
    # writes) was listed `no (lease expired 0s ago)` beside LEASE +1.6s: not up while its lease
    # runs means deregistered.
    _fill_status(harness)
    lease = timestamp_pb2.Timestamp()
    lease.FromDatetime(datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=5))
    harness.replicas.append(
        broker_pb2.ReplicaInfo(replica_id="dit-9", role=common_pb2.REPLICA_ROLE_DIT, endpoint="10.0.0.9:50071",
                               incarnation_id="dddd4444", up=False, lease_expire_time=lease)
    )
    assert run_status(argparse.Namespace(target=server.address, json=False, token=None)) == 0
    replica_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("dit-9 "))
    assert "no (deregistered)" in replica_row and "lease expired" not in replica_row


def test_status_shows_journaled_replicas_that_are_not_live_as_down_and_not_capacity(
    server: ServerThread, harness: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found black-box: an earlier config's DiT replicas, kept in a shared journal, were listed
    # with their pools 4096 FREE as if a request could get them.
    _fill_status(harness)
    harness.replicas.append(
        broker_pb2.ReplicaInfo(replica_id="old-dit", role=common_pb2.REPLICA_ROLE_DIT, endpoint="10.0.0.9:50071",
                               incarnation_id="cccc3333", up=False)
    )
    harness.pools.append(
        broker_pb2.PoolStatus(replica_id="old-dit", total_pages=4096, free_pages=4094, draining_pages=2, up=False)
    )
    assert run_status(argparse.Namespace(target=server.address, json=False, token=None)) == 0
    lines = capsys.readouterr().out.splitlines()
    replica_row = next(line for line in lines if line.startswith("old-dit ") and "10.0.0.9" in line)
    assert "no (not seen since the broker started)" in replica_row
    pool_row = next(line for line in lines if line.startswith("old-dit ") and "4096" in line)
    assert pool_row.split()[:6] == ["old-dit", "DOWN", "4096", "-", "0", "2"]
    assert "4094" not in "\n".join(lines)
    summary = next(line for line in lines if line.startswith("live:"))
    assert summary == "live: 1 pool(s), 64 pages, 60 available; not live (not counted): 1 pool(s), 2 pages still held"
    assert run_status(argparse.Namespace(target=server.address, json=True, token=None)) == 0
    pools = {p["replica_id"]: p for p in json.loads(capsys.readouterr().out)["pools"]}
    assert (pools["old-dit"]["up"], pools["old-dit"]["available_pages"]) == (False, 0)
    assert (pools["dit-0"]["up"], pools["dit-0"]["available_pages"]) == (True, 60)


def test_status_groups_the_refused_incarnations_by_replica_id_latest_last(
    server: ServerThread, harness: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    _fill_status(harness)
    harness.forgotten_incarnations += [
        broker_pb2.ForgottenIncarnation(replica_id=r, incarnation_id=i)
        for r, i in (("dit-0", "aaaa1111-old"), ("dit-0", "bbbb2222-new"), ("ar-1", "cccc3333"))
    ]
    assert run_status(argparse.Namespace(target=server.address, json=False, token=None)) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("REFUSED")))
    assert lines[header].split()[-2:] == ["INCARNATIONS", "LATEST"]
    assert [line.split() for line in lines[header + 1 : header + 3]] == [["ar-1", "1", "cccc3333"],
                                                                         ["dit-0", "2", "bbbb2222"]]  # fmt: skip
    assert run_status(argparse.Namespace(target=server.address, json=True, token=None)) == 0
    assert json.loads(capsys.readouterr().out)["forgotten_incarnations"] == [
        {"replica_id": "dit-0", "incarnation_id": "aaaa1111-old"},
        {"replica_id": "dit-0", "incarnation_id": "bbbb2222-new"},
        {"replica_id": "ar-1", "incarnation_id": "cccc3333"},
    ]


def test_status_json_and_empty_broker(
    server: ServerThread, harness: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_status(argparse.Namespace(target=server.address, json=False, token=None)) == 0
    out = capsys.readouterr().out
    assert "none registered" in out and "none in flight" in out and "REFUSED" not in out
    _fill_status(harness)
    assert run_status(argparse.Namespace(target=server.address, json=True, token=None)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["replica_id"] for r in doc["replicas"]] == ["ar-0", "dit-0"]
    assert doc["replicas"][1]["role"] == "DIT" and doc["replicas"][1]["fenced"] is True
    assert doc["pools"][0]["free_pages"] == 60
    assert doc["tickets"][0]["state"] == "WRITING" and doc["tickets"][0]["rows"][0]["page_ids"] == [0, 1]


def test_list_without_limit_shows_every_generation_not_the_apis_default_page(
    server: ServerThread, harness: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found black-box: `kvrelay list` ("default: all the broker keeps") sent page_size 0, which
    # the broker answers with its newest 100: 113 kept, 100 listed.
    from kvrelay.client.cli import run_list
    from kvrelay.limits import DEFAULT_LIST_PAGE_SIZE

    kept = DEFAULT_LIST_PAGE_SIZE + 20
    for i in range(kept):
        generation = generation_pb2.Generation(request_id=f"r-{i}", state=generation_pb2.GENERATION_STATE_SUCCEEDED)
        harness.generations[f"r-{i}"] = Gen(generation)

    def listed(**options: object) -> list[str]:
        args = argparse.Namespace(target=server.address, json=True, token=None, state=None, limit=0)
        vars(args).update(options)
        assert run_list(args) == 0
        return [g["request_id"] for g in json.loads(capsys.readouterr().out)["generations"]]

    assert len(listed()) == kept
    assert listed(limit=3) == [f"r-{kept - 1}", f"r-{kept - 2}", f"r-{kept - 3}"]


def test_status_error_exits_1_with_the_code(capsys: pytest.CaptureFixture[str]) -> None:
    os.environ.pop("KVRELAY_API_TOKEN", None)
    started = time.monotonic()
    assert run_status(argparse.Namespace(target="127.0.0.1:1", json=False, token=None)) == 1
    err = capsys.readouterr().err
    assert "kvrelay status: UNAVAILABLE" in err
    assert time.monotonic() - started < 15
    # Nothing listens there: the hint says so and names the target, not TLS (a refused connection
    # is never a TLS mismatch).
    assert "hint: nothing listens at 127.0.0.1:1" in err and "--tls-ca" not in err


def test_status_uses_the_token(
    server: ServerThread, harness: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    harness.token = "tok"
    assert run_status(argparse.Namespace(target=server.address, json=True, token=None)) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert run_status(argparse.Namespace(target=server.address, json=True, token="tok")) == 0


def test_the_prompt_comes_from_the_argument_a_file_or_stdin(tmp_path: Path) -> None:
    import io

    from kvrelay.client.cli import read_prompt

    class _Pipe(io.StringIO):
        def isatty(self) -> bool:
            return False

    def ns(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(**{"prompt": None, "prompt_file": None, **kw})

    assert read_prompt(ns(prompt="a fox"), _Pipe("")) == "a fox"
    assert read_prompt(ns(prompt="-"), _Pipe("a fox\nin the snow\n\n")) == "a fox\nin the snow"
    path = tmp_path / "p.txt"
    path.write_text("a long prompt\r\n")
    assert read_prompt(ns(prompt_file=str(path)), _Pipe("")) == "a long prompt"
    assert read_prompt(ns(prompt_file="-"), _Pipe("piped")) == "piped"
    # No stdin at all (`kvrelay generate - <&-`: Python's sys.stdin is None) was an AttributeError.
    for args in (ns(prompt="-"), ns(prompt_file="-")):
        with pytest.raises(ValueError, match="^reading the prompt from stdin, but there is no stdin"):
            read_prompt(args, None)  # type: ignore[arg-type]
    for bad, match in (
        (ns(), "no prompt"),
        (ns(prompt="a", prompt_file=str(path)), "not both"),
        (ns(prompt_file=str(tmp_path / "missing.txt")), "cannot read"),
        (ns(prompt="-"), "empty"),
    ):
        with pytest.raises(ValueError, match=match):
            read_prompt(bad, _Pipe("  \n"))
    # More than the broker ever takes (1 MiB of UTF-8) is refused after reading just past it:
    # found black-box, `--prompt-file /dev/zero` read until MemoryError (or the machine's memory).
    from kvrelay.limits import MAX_PROMPT_BYTES

    assert read_prompt(ns(prompt="-"), _Pipe("a" * MAX_PROMPT_BYTES)) == "a" * MAX_PROMPT_BYTES
    big = tmp_path / "big.txt"
    big.write_text("b" * (3 * MAX_PROMPT_BYTES))
    for args, where in ((ns(prompt="-"), "stdin"), (ns(prompt_file=str(big)), f"--prompt-file {big}")):
        with pytest.raises(ValueError) as err:
            read_prompt(args, _Pipe("a" * (MAX_PROMPT_BYTES + 1)))
        assert str(err.value) == (
            f"the prompt from {where} is longer than {MAX_PROMPT_BYTES} characters: "
            f"the broker takes at most {MAX_PROMPT_BYTES} bytes of UTF-8 (1 MiB)"
        )


@pytest.mark.parametrize("tls", [False, True])
def test_a_target_that_accepts_but_never_answers_is_not_hinted_as_tls(tls: bool) -> None:
    # A stopped broker (SIGSTOP) still accepts connections (the kernel's backlog) and says
    # nothing: `kvrelay generate` ended after gRPC's 20 s connect timeout with "connection attempt
    # timed out before receiving SETTINGS frame" and the hint "is the broker serving TLS?" (found
    # black-box). A TLS mismatch fails at once with another message. The message is the one gRPC
    # gave; waiting out the 20 s here would make a slow test of gRPC's timer.
    import io

    from kvrelay.client import KvRelayError
    from kvrelay.client.cli import _print_error

    target = "127.0.0.1:47051"
    err = KvRelayError(
        "UNAVAILABLE", "UNAVAILABLE",
        f"failed to connect to all addresses; last error: UNKNOWN: ipv4:{target}: connection attempt timed out "
        "before receiving SETTINGS frame",
    )  # fmt: skip
    out = io.StringIO()
    _print_error("generate", err, out, tls=tls, target=target)
    hint = out.getvalue().splitlines()[-1]
    assert hint == (f"  hint: {target} accepted the connection but never answered: is the broker stopped or hung "
                    "(check it, or kvrelay up's log), or is --target another service?")  # fmt: skip
    assert "TLS" not in hint


@pytest.mark.parametrize("command", ["status", "list", "cancel"])
def test_a_broker_that_never_answers_a_read_is_hinted(command: str) -> None:
    # `kvrelay status` against a stopped (SIGSTOP) broker printed only "DEADLINE_EXCEEDED:
    # Deadline Exceeded" after its 10 s (found black-box; the error is built here, as gRPC gave it).
    import io

    from kvrelay.client import KvRelayError
    from kvrelay.client.cli import _print_error

    out = io.StringIO()
    _print_error(command, KvRelayError("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", "Deadline Exceeded"), out,
                 tls=False, target="127.0.0.1:47051")  # fmt: skip
    assert out.getvalue().splitlines() == [
        f"kvrelay {command}: DEADLINE_EXCEEDED: Deadline Exceeded",
        "  hint: 127.0.0.1:47051 did not answer within 10 s: is the broker stopped, hung or overloaded (check it, "
        "or kvrelay up's log)?",
    ]


def test_unresolvable_target_hints_at_the_target_not_tls(capsys: pytest.CaptureFixture[str]) -> None:
    os.environ.pop("KVRELAY_API_TOKEN", None)
    target = "kvrelay-no-such-host.invalid:50051"
    assert run_status(argparse.Namespace(target=target, json=False, token=None)) == 1
    err = capsys.readouterr().err
    assert "kvrelay status: UNAVAILABLE" in err
    # A name that does not resolve is never a TLS mismatch (the hint used to say "serving TLS?").
    assert f"hint: cannot resolve the host of {target}" in err and "--tls-ca" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["list", "--limit", "-1"], "argument --limit: must be 0 or more, got -1"),
        (["list", "--limit", "x"], "argument --limit: expected an integer, got 'x'"),
        (["generate", "x", "--timeout", "0"], "argument --timeout: must be a positive number of seconds"),
        (["generate", "x", "--timeout", "-5"], "argument --timeout: must be a positive number of seconds"),
        (["health", "--timeout", "nan"], "argument --timeout: must be a positive number of seconds"),
        # 1e10 s is a deadline past 2262: it ended DEADLINE_EXCEEDED at once, nothing sent.
        (["generate", "x", "--timeout", "1e10"], "argument --timeout: must be a positive number of seconds, at most 1e+09"),
        (["bench", "--runs", "0"], "argument --runs: must be at least 1, got 0"),
        (["bench", "--requests", "0"], "argument --requests: must be at least 1, got 0"),
        (["bench", "--concurrency", "0"], "argument --concurrency: must be at least 1, got 0"),
    ],
)
def test_counts_and_timeouts_that_can_only_be_mistakes_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # They were a traceback (--limit -1), an already-expired deadline (--timeout 0) or an empty
    # benchmark table that said "all requests completed: True" (--runs 0).
    from kvrelay.node.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_reader_that_leaves_the_pipe_is_not_a_traceback() -> None:
    # `kvrelay list | head -1` printed a BrokenPipeError traceback.
    code = (
        "import sys, kvrelay.client.cli as c, kvrelay.node.cli as cli\n"
        "def spam(args):\n"
        "    for _ in range(200000):\n"
        "        print('x' * 100)\n"
        "c.run_list = spam\n"
        "sys.exit(cli.main(['list']))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 128 + signal.SIGPIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_tables_escape_what_a_terminal_would_act_on() -> None:
    # Found black-box: an api client's prompt reached `kvrelay list` on the operator's terminal
    # as is: OSC 52 (write the operator's clipboard), cursor-up and erase-line (rewrite the rows
    # above). Every table cell is another caller's text; none may drive the terminal.
    import datetime as dt

    from kvrelay.client.cli import format_table, generations_table
    from kvrelay.client.types import Generation, GenerationParams, GenerationState

    hostile = "\x1b]52;c;ZWNobyBwd25lZA==\x07\x1b[2K\x1b[1Ared\u202eTXT.exe\x9b"
    now = dt.datetime.now(dt.UTC)
    params = GenerationParams(hostile, "", 1, 64, 64, 1, 1.0)
    generation = Generation("r-1", GenerationState.SUCCEEDED, params, 1, 1, None, None, None, "", now, now)
    for out in (generations_table([generation], now), format_table(("REPLICA",), [(hostile,)])):
        assert all(c.isprintable() or c == "\n" for c in out), repr(out)
        assert "\\x1b]52;c;" in out and "\\u202e" in out
    assert format_table(("PROMPT",), [("a red fox, ünïcode ✓",)]).endswith("a red fox, ünïcode ✓")


@pytest.mark.parametrize("command", ["generate", "cancel"])
def test_a_request_id_past_the_bound_is_refused_before_sending_and_not_echoed_whole(
    command: str, server: ServerThread, harness: Harness, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found black-box: `kvrelay generate --request-id <5,000 characters>` echoed the id in full.
    from kvrelay.node.cli import main

    huge = "a" * 5000
    argv = ["generate", "a fox", "--request-id", huge, "-q", "-o", str(tmp_path / "x.png")]
    if command == "cancel":
        argv = ["cancel", huge]
    assert main([*argv, "--target", server.address]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"kvrelay {command}: INVALID_ARGUMENT: request_id: at most 128 characters of [A-Za-z0-9._:~-], "
        f"got 5000 characters: '{'a' * 40}'...\n  field: request_id\n"
        + ("  hint: request_id is --request-id here\n" if command == "generate" else "")
    )
    # Refused by the SDK with the broker's own bound (kvrelay.limits): nothing was sent.
    assert harness.calls["Generate"] == harness.calls["CancelGeneration"] == 0
    assert not harness.generate_requests


def test_errors_show_a_long_request_id_cut_with_its_length() -> None:
    import io

    from kvrelay.client.cli import _print_error
    from kvrelay.client.errors import KvRelayError

    def shown(request_id: str) -> str:
        stream = io.StringIO()
        err = KvRelayError("NOT_FOUND", "GENERATION_NOT_FOUND", "unknown generation", {"request_id": request_id},
                           request_id=request_id)  # fmt: skip
        _print_error("cancel", err, stream)
        return stream.getvalue()

    longest = "k" * 128
    assert shown(longest) == f"kvrelay cancel: NOT_FOUND (GENERATION_NOT_FOUND): unknown generation\n  request_id: {longest}\n"
    twice = "x" * 300
    assert shown(twice) == (
        "kvrelay cancel: NOT_FOUND (GENERATION_NOT_FOUND): unknown generation\n"
        f"  request_id: {'x' * 40}... (300 characters)\n"
    )
    other = shown("a\x1b[2Kb")
    assert "a\\x1b[2Kb" in other and "\x1b" not in other
    # Details that carry another id than the error's own are cut the same way.
    stream = io.StringIO()
    _print_error("generate", KvRelayError("ALREADY_EXISTS", "REQUEST_ID_REUSED", "reused", {"request_id": twice}), stream)
    assert stream.getvalue().endswith(f"  request_id: {'x' * 40}... (300 characters)\n")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "-1"], "num_inference_steps: must be in [1, 1000], got -1"),
        (["--steps", "0"], "num_inference_steps: must be in [1, 1000], got 0"),
        (["--width", "-64"], "width: must be a multiple of 16 in [64, 2048], got -64"),
        (["--height", "4096"], "height: must be a multiple of 16 in [64, 2048], got 4096"),
        (["--guidance-scale", "0.5"], "guidance_scale: must be finite and >= 1.0 (1.0 = no CFG), got 0.5"),
        (["--seed", "-1"], "seed: must be in [0, 2**64), got -1"),
    ],
)
def test_generate_names_the_brokers_bounds_before_sending(
    flags: list[str], message: str, server: ServerThread, harness: Harness, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `kvrelay generate --steps -1` said "must be in [0, 2**32)", the wire's range, not the broker's.
    from kvrelay.node.cli import main

    argv = ["generate", "a fox", *flags, "-q", "-o", str(tmp_path / "x.png"), "--target", server.address]
    assert main(argv) == 1
    field = message.split(":", 1)[0]
    # A field whose flag has another name says which flag (tests/cli/test_new_user_hints.py).
    flag = {"num_inference_steps": "--steps", "guidance_scale": "--guidance-scale"}.get(field)
    hint = f"  hint: {field} is {flag} here\n" if flag else ""
    assert capsys.readouterr().err == f"kvrelay generate: INVALID_ARGUMENT: {message}\n  field: {field}\n{hint}"
    assert harness.calls["Generate"] == 0
