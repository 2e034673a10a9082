"""Image statistics that tell whether a demo picture shows what its caption asked for: the
colour at the asked place, the background colour away from it, and where the shape's pixels are.
(A corrupted KV prefix draws the wrong colour or place, which no bit-equality check between two
transports can notice.)"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvrelay.models.demo import COLOURS, PLACES, nearest_colour


@dataclass(frozen=True, slots=True)
class Verdict:
    shape_colour: str  # nearest palette colour at the asked place
    background: str  # nearest palette colour far from it
    centroid: tuple[float, float]  # of the pixels nearest to the asked colour, as fractions (x, y)
    ok: bool


def judge(image: np.ndarray, colour: str, background: str, place: str) -> Verdict:
    h, w, _ = image.shape
    px = image.astype(np.float64)
    cx, cy = PLACES[place]
    # The shape's middle: a window a tenth of the picture wide around the asked centre.
    win = px[int((cy - 0.05) * h) : int((cy + 0.05) * h), int((cx - 0.05) * w) : int((cx + 0.05) * w)]
    shape_colour = nearest_colour(tuple(win.reshape(-1, 3).mean(axis=0)))
    # The background: the corner farthest from the shape.
    bx, by = (0.08 if cx >= 0.5 else 0.92), (0.08 if cy >= 0.5 else 0.92)
    corner = px[int((by - 0.05) * h) : int((by + 0.05) * h), int((bx - 0.05) * w) : int((bx + 0.05) * w)]
    bg = nearest_colour(tuple(corner.reshape(-1, 3).mean(axis=0)))
    # Pixels closer to the asked colour than to the asked background: the shape.
    fg_c, bg_c = np.array(COLOURS[colour], dtype=np.float64), np.array(COLOURS[background], dtype=np.float64)
    mask = ((px - fg_c) ** 2).sum(-1) < ((px - bg_c) ** 2).sum(-1)
    if mask.sum() < 0.005 * h * w:
        centroid = (-1.0, -1.0)
    else:
        ys, xs = np.nonzero(mask)
        centroid = (float(xs.mean() + 0.5) / w, float(ys.mean() + 0.5) / h)
    near = abs(centroid[0] - cx) < 0.15 and abs(centroid[1] - cy) < 0.15
    return Verdict(shape_colour, bg, centroid, shape_colour == colour and bg == background and near)
