"""Rewrite a wheel in place without the named members (and their RECORD lines).

Usage: python benchmarks/gpu/slim_wheel.py WHEEL MEMBER...
Used by fetch.sh to keep the carried .gpu/ under the device tool's 64 MiB.
"""
from __future__ import annotations

import os
import sys
import zipfile


def slim(wheel: str, drop: set[str]) -> None:
    tmp = wheel + ".tmp"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename in drop:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if ln.split(",", 1)[0] not in drop).encode()
            dst.writestr(info, data)
    os.replace(tmp, wheel)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    slim(sys.argv[1], set(sys.argv[2:]))
