"""Files kvrelay ships beside its code: the configs and the demo prompt dataset.

A checkout has them at `configs/` and `benchmarks/data/`; the wheel carries the same files as
`kvrelay/configs/` and `kvrelay/data/`, so a pip-installed kvrelay runs `kvrelay up`, `generate`
and `bench` from any directory. A path that exists as given always wins. Pure stdlib.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent

# kind -> (where the wheel puts them, where a checkout has them, the prefix paths are written with)
_PLACES = {
    "configs": (_PACKAGE / "configs", _CHECKOUT / "configs", ("configs",)),
    "data": (_PACKAGE / "data", _CHECKOUT / "benchmarks" / "data", ("benchmarks", "data")),
}


def shipped_dir(kind: str) -> Path | None:
    """The folder holding the shipped files of `kind` ("configs" or "data"), if any."""
    installed, checkout, _ = _PLACES[kind]
    for folder in (installed, checkout):
        if folder.is_dir():
            return folder
    return None


def shipped_names(kind: str) -> list[str]:
    folder = shipped_dir(kind)
    return sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith(("_", "."))) if folder else []


def resolve(path: str | os.PathLike[str], kind: str) -> Path:
    """`path` if it exists; else the shipped file it names (`configs/single-node.yaml`,
    `single-node.yaml`, `benchmarks/data/t2i-50.jsonl`); else `path` unchanged (the caller's
    error then names what was asked for)."""
    given = Path(path)
    if given.exists():
        return given
    _, _, prefix = _PLACES[kind]
    parts = given.parts
    if len(parts) == 1 or tuple(parts[:-1]) == prefix:
        folder = shipped_dir(kind)
        if folder is not None and (folder / parts[-1]).is_file():
            return folder / parts[-1]
    return given
