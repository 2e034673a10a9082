"""kvrelay: disaggregated AR -> DiT serving with broker-owned KV pages.

`import kvrelay` stays light: no torch, no gRPC server, no service package.
"""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"
# Version of the page layout (DESIGN.md section 3); replicas of one deployment must agree.
LAYOUT_VERSION = 1

# Running from a source checkout without installing (e.g. `python -m kvrelay` on a GPU host):
# the service packages live beside kvrelay/ (DESIGN.md section 2) and the wheel maps them under
# `kvrelay.`; here the checkout's root joins the package path so `kvrelay.broker` resolves the same.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "broker")) and _os.path.isfile(
    _os.path.join(_root, "broker", "__init__.py")
):
    __path__.append(_root)  # noqa: F821
