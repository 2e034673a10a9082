"""Bytes in a journaled generation (its PNG) are stored as BLOBs beside the JSON, not as base64
inside it (broker CPU per request), and come back as the same bytes; rows journaled before, with
base64 text, still restore."""

from __future__ import annotations

import base64
import os
from pathlib import Path

from kvrelay.broker.generations import record_from_json
from kvrelay.broker.journal import Journal


def test_bytes_round_trip_as_blobs_and_leave_with_their_row(tmp_path: Path) -> None:
    png = os.urandom(50_000)
    journal = Journal(tmp_path / "j.sqlite", synchronous="OFF")
    try:
        journal.commit(generations={"r1": {"image": {"png": png, "width": 8}, "state": "SUCCEEDED"}})
        text = journal._db.execute("SELECT data FROM generations").fetchone()[0]  # noqa: SLF001
        assert len(text) < 200, "the JSON holds a placeholder, not the image"
        assert journal.load().generations["r1"] == {"image": {"png": png, "width": 8}, "state": "SUCCEEDED"}
        # Replacing a row replaces its blobs; deleting it deletes them.
        journal.commit(generations={"r1": {"image": {"png": b"\x89PNG", "width": 8}, "state": "SUCCEEDED"}})
        assert journal.load().generations["r1"]["image"]["png"] == b"\x89PNG"
        journal.commit(generations={"r1": None})
        assert journal.load().generations == {}
        assert journal._db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == 0  # noqa: SLF001
    finally:
        journal.close()


def test_a_generation_journaled_with_base64_text_still_restores(tmp_path: Path) -> None:
    png = os.urandom(1_000)
    old = {
        "request_id": "r0", "params": {"prompt": "p", "negative_prompt": "", "seed": 1, "width": 64, "height": 64,
                                       "num_inference_steps": 1, "guidance_scale": 1.0},
        "state": "SUCCEEDED", "step": 1,
        "image": {"png": base64.b64encode(png).decode(), "width": 64, "height": 64, "seed": 1},
        "timings": {}, "error": None, "ticket_id": "t0", "create_time": 1.0, "update_time": 2.0,
        "finished_wall": 2.0,
    }  # fmt: skip
    journal = Journal(tmp_path / "j.sqlite", synchronous="OFF")
    try:
        journal.commit(generations={"r0": old})
        record = record_from_json(journal.load().generations["r0"], 100.0)
    finally:
        journal.close()
    assert record.image is not None and record.image.png == png
