"""Contact-map figure as a PNG, with a minimal PNG writer and a small bitmap font (zlib only, no
plotting library): titles, axis labels and ticks, a colour bar and a legend."""

from __future__ import annotations

import struct
import zlib
from typing import Optional, Sequence

import torch

WHITE = (255, 255, 255)
BLACK = (0, 0, 0)
GREEN = (0, 160, 60)
RED = (220, 30, 30)
DIAGONAL = (200, 200, 200)
FRAME = (120, 120, 120)

# A 5 x 9 pixel font: rows top to bottom, '#' ink; rows 0-6 carry capitals, digits and ascenders
# (lower case from row 2), rows 7-8 the descenders. A glyph of fewer rows is padded with blank ones.
_FONT_ROWS = {
    " ": "",
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "####. ....# ....# .###. ....# ....# ####.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": ".###. #.... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ....# .###.",
    "L": "#.... #.... #.... #.... #.... #.... #####",
    "P": "####. #...# #...# ####. #.... #.... #....",
    "a": "..... ..... .###. ....# .#### #...# .####",
    "b": "#.... #.... #.##. ##..# #...# #...# ####.",
    "c": "..... ..... .###. #.... #.... #...# .###.",
    "d": "....# ....# .##.# #..## #...# #...# .####",
    "e": "..... ..... .###. #...# ##### #.... .###.",
    "f": "..##. .#..# .#... ###.. .#... .#... .#...",
    "g": "..... ..... .#### #...# #...# #...# .#### ....# .###.",
    "h": "#.... #.... #.##. ##..# #...# #...# #...#",
    "i": "..#.. ..... .##.. ..#.. ..#.. ..#.. .###.",
    "j": "...#. ..... ..##. ...#. ...#. ...#. ...#. #..#. .##..",
    "k": "#.... #.... #..#. #.#.. ##... #.#.. #..#.",
    "l": ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "m": "..... ..... ##.#. #.#.# #.#.# #.#.# #.#.#",
    "n": "..... ..... #.##. ##..# #...# #...# #...#",
    "o": "..... ..... .###. #...# #...# #...# .###.",
    "p": "..... ..... ####. #...# #...# #...# ####. #.... #....",
    "q": "..... ..... .#### #...# #...# #...# .#### ....# ....#",
    "r": "..... ..... #.##. ##..# #.... #.... #....",
    "s": "..... ..... .#### #.... .###. ....# ####.",
    "t": ".#... .#... ###.. .#... .#... .#..# ..##.",
    "u": "..... ..... #...# #...# #...# #..## .##.#",
    "v": "..... ..... #...# #...# #...# .#.#. ..#..",
    "w": "..... ..... #...# #...# #.#.# #.#.# .#.#.",
    "x": "..... ..... #...# .#.#. ..#.. .#.#. #...#",
    "y": "..... ..... #...# #...# #...# #...# .#### ....# .###.",
    "z": "..... ..... ##### ...#. ..#.. .#... #####",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... ..... .##.. .##.. ..#.. .#...",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    ";": "..... .##.. .##.. ..... .##.. .##.. ..#.. .#...",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "=": "..... ..... ##### ..... ##### ..... .....",
    "-": "..... ..... ..... ##### ..... ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "/": "....# ....# ...#. ..#.. .#... #.... #....",
    "|": "..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    ">": ".#... ..#.. ...#. ....# ...#. ..#.. .#...",
    "<": "...#. ..#.. .#... #.... .#... ..#.. ...#.",
}
GLYPH_HEIGHT, GLYPH_WIDTH = 9, 5


def _glyph(rows: str) -> torch.Tensor:
    lines = rows.split() + ["." * GLYPH_WIDTH] * (GLYPH_HEIGHT - len(rows.split()))
    return torch.tensor([[c == "#" for c in line] for line in lines], dtype=torch.bool)  # [9, 5]


FONT = {char: _glyph(rows) for char, rows in _FONT_ROWS.items()}


def text_mask(text: str) -> torch.Tensor:
    """``text`` in the bitmap font: ``[9, 6 * len(text) - 1]`` bool, True where there is ink (one
    blank column between glyphs). Raises ``ValueError`` for a character without a glyph."""
    missing = sorted({c for c in text if c not in FONT})
    if missing:
        raise ValueError(f"the plot font has no glyph for {missing} (in {text!r})")
    gap = torch.zeros(GLYPH_HEIGHT, 1, dtype=torch.bool)
    columns = [part for i, c in enumerate(text) for part in ((gap, FONT[c]) if i else (FONT[c],))]
    return torch.cat(columns, dim=1) if columns else torch.zeros(GLYPH_HEIGHT, 0, dtype=torch.bool)


def text_image(text: str, scale: int = 1, colour=BLACK, vertical: bool = False) -> torch.Tensor:
    """``text`` as ``[H, W, 3]`` uint8 on white, each font pixel ``scale`` x ``scale``; ``vertical``
    turns it to read from bottom to top (a y-axis label)."""
    mask = text_mask(text).repeat_interleave(scale, dim=0).repeat_interleave(scale, dim=1)
    if vertical:
        mask = mask.rot90(1)  # [W, H]: the first letter at the bottom
    image = _blank(*mask.shape)
    image[mask] = torch.tensor(colour, dtype=torch.uint8)
    return image


def _blank(height: int, width: int) -> torch.Tensor:
    return torch.full((height, width, 3), 255, dtype=torch.uint8)


def _paste(canvas: torch.Tensor, image: torch.Tensor, top: int, left: int) -> None:
    canvas[top : top + image.shape[0], left : left + image.shape[1]] = image


def _stack(images: Sequence[torch.Tensor], dim: int, gap: int, center: bool = False) -> torch.Tensor:
    """``images`` one after the other along ``dim`` (0: down, 1: across) with ``gap`` white pixels
    between them; across the other dim each sits at the start, or in the middle with ``center``."""
    other = 1 - dim
    size = [0, 0]
    size[dim] = sum(image.shape[dim] for image in images) + gap * (len(images) - 1)
    size[other] = max(image.shape[other] for image in images)
    canvas = _blank(*size)
    at = 0
    for image in images:
        offset = (size[other] - image.shape[other]) // 2 if center else 0
        _paste(canvas, image, *((at, offset) if dim == 0 else (offset, at)))
        at += image.shape[dim] + gap
    return canvas


def probability_colour(p: torch.Tensor) -> torch.Tensor:
    """The colour of a contact probability ``p [*]`` (white at 0, dark blue at 1) as float ``[*, 3]``."""
    p = p.float().clamp(0, 1)
    return torch.stack([255 * (1 - p), 255 * (1 - 0.8 * p), 255 * (1 - 0.45 * p)], dim=-1)


def contact_panel(probs: torch.Tensor, contacts: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """One protein as ``[L, L, 3]`` uint8.

    Above the diagonal: predicted contact probability (:func:`probability_colour`), with the
    top-L/5 long-range picks in green (true contact) or red (not a contact). Below the diagonal:
    the true contacts in black.
    """
    length = probs.shape[0]
    blue = probability_colour(probs)  # [L, L, 3]
    truth = torch.where(contacts[..., None], torch.zeros(3), torch.tensor(WHITE, dtype=torch.float32))
    upper = torch.ones(length, length, dtype=torch.bool).triu(1)[..., None]
    panel = torch.where(upper, blue, truth)
    picks = top & upper[..., 0]
    panel[picks & contacts] = torch.tensor(GREEN, dtype=torch.float32)
    panel[picks & ~contacts] = torch.tensor(RED, dtype=torch.float32)
    idx = torch.arange(length)
    panel[idx, idx] = torch.tensor(DIAGONAL, dtype=torch.float32)
    return panel.round().to(torch.uint8)


def _framed(image: torch.Tensor) -> torch.Tensor:
    """``image`` inside a one-pixel grey frame."""
    canvas = torch.empty(image.shape[0] + 2, image.shape[1] + 2, 3, dtype=torch.uint8)
    canvas[:] = torch.tensor(FRAME, dtype=torch.uint8)
    _paste(canvas, image, 1, 1)
    return canvas


def _ticks(length: int) -> list[int]:
    """The residue numbers (1-based) marked on an axis of ``length`` residues: 1, then every 10th."""
    return [1] + list(range(10, length + 1, 10))


def _labelled_map(panel: torch.Tensor, title: str, scale: int) -> torch.Tensor:
    """One enlarged, framed panel with its title above, residue ticks and "residue j" below, and
    residue ticks and a vertical "residue i" on its left."""
    length = panel.shape[0]
    framed = _framed(panel.repeat_interleave(scale, dim=0).repeat_interleave(scale, dim=1))
    side = framed.shape[0]
    number_width = max(text_mask(str(r)).shape[1] for r in _ticks(length))
    tick = 3
    left = GLYPH_HEIGHT + 3 + number_width + 2 + tick  # y label, numbers, tick marks
    title_image = text_image(title)
    top = GLYPH_HEIGHT + 4
    title_left = max(0, left + (side - title_image.shape[1]) // 2)  # centred over the map where it fits
    width = max(left + side, title_left + title_image.shape[1])
    height = top + side + tick + 2 + GLYPH_HEIGHT + 4 + GLYPH_HEIGHT
    canvas = _blank(height, width)
    _paste(canvas, framed, top, left)
    _paste(canvas, title_image, 0, title_left)
    ink = torch.tensor(BLACK, dtype=torch.uint8)
    for residue in _ticks(length):
        centre = 1 + (residue - 1) * scale + scale // 2  # the residue's middle pixel inside the frame
        number = text_image(str(residue))
        canvas[top + side : top + side + tick, left + centre] = ink  # x axis (j) below the map
        x = min(max(0, left + centre - number.shape[1] // 2), width - number.shape[1])
        _paste(canvas, number, top + side + tick + 2, x)
        canvas[top + centre, left - tick : left] = ink  # y axis (i) on the left
        _paste(canvas, number, top + centre - GLYPH_HEIGHT // 2, left - tick - 2 - number.shape[1])
    x_label = text_image("residue j")
    _paste(canvas, x_label, height - GLYPH_HEIGHT, left + (side - x_label.shape[1]) // 2)
    y_label = text_image("residue i", vertical=True)
    _paste(canvas, y_label, top + (side - y_label.shape[0]) // 2, 0)
    return canvas


def colour_bar(height: int, width: int = 12) -> torch.Tensor:
    """The colour bar of :func:`probability_colour`: "P(contact)" above a framed bar from 1 (top) to
    0 (bottom), ``height`` pixels inside the frame, ticked at 0, 0.5 and 1."""
    p = torch.linspace(1, 0, height)  # [height]: row r shows p[r]
    bar = probability_colour(p)[:, None, :].expand(height, width, 3).round().to(torch.uint8)
    framed = _framed(bar)
    tick = 3
    labels = {"1": 0, "0.5": (height - 1) // 2, "0": height - 1}  # text -> row inside the frame
    label_width = max(text_mask(text).shape[1] for text in labels)
    body = _blank(framed.shape[0] + GLYPH_HEIGHT, framed.shape[1] + tick + 2 + label_width)
    top = GLYPH_HEIGHT // 2  # room for the half glyph of the labels at the ends
    _paste(body, framed, top, 0)
    for text, row in labels.items():
        body[top + 1 + row, framed.shape[1] : framed.shape[1] + tick] = torch.tensor(BLACK, dtype=torch.uint8)
        _paste(body, text_image(text), top + 1 + row - GLYPH_HEIGHT // 2, framed.shape[1] + tick + 2)
    return _stack([text_image("P(contact)"), body], dim=0, gap=2)


def _legend(min_separation: Optional[int]) -> torch.Tensor:
    where = "" if min_separation is None else f" with |i - j| >= {min_separation}"
    entries = [
        (GREEN, f"top-L/5 predicted pair{where}: a true contact"),
        (RED, f"top-L/5 predicted pair{where}: not a contact"),
        (BLACK, "true contact (below the diagonal)"),
    ]
    lines = []
    for colour, text in entries:
        swatch = torch.tensor(colour, dtype=torch.uint8).expand(GLYPH_HEIGHT - 2, GLYPH_HEIGHT - 2, 3).clone()
        lines.append(_stack([_framed(swatch), text_image(text)], dim=1, gap=5))
    return _stack(lines, dim=0, gap=4)


def contact_figure(
    panels: list[torch.Tensor],
    titles: Optional[Sequence[str]] = None,
    min_separation: Optional[int] = None,
    scale: int = 4,
    margin: int = 8,
) -> torch.Tensor:
    """The figure of :func:`contact_panel` panels as ``[H, W, 3]`` uint8: a title, the panels side by
    side (each enlarged ``scale`` times, titled ``titles[k]`` or "protein k (L = n)", with residue
    axes i and j), the colour bar of the predicted probability and a legend of the marks (the picks'
    ``min_separation`` named where given)."""
    if titles is None:
        titles = [f"protein {k + 1} (L = {p.shape[0]})" for k, p in enumerate(panels)]
    if len(titles) != len(panels):
        raise ValueError(f"`titles` must have one entry per panel ({len(panels)}), got {len(titles)}")
    maps = [_labelled_map(panel, title, scale) for panel, title in zip(panels, titles)]
    bar_height = max(p.shape[0] for p in panels) * scale
    row = _stack([*maps, colour_bar(bar_height)], dim=1, gap=3 * margin)
    heading = _stack(
        [text_image("held-out contact maps", scale=2),
         text_image("above the diagonal: predicted P(contact); below: true contacts")],
        dim=0, gap=4,
    )
    body = _stack([heading, row, _legend(min_separation)], dim=0, gap=2 * margin)
    canvas = _blank(body.shape[0] + 2 * margin, body.shape[1] + 2 * margin)
    _paste(canvas, body, margin, margin)
    return canvas


def write_png(path: str, image: torch.Tensor) -> None:
    """Writes ``image`` (``[H, W, 3]`` uint8 RGB) as an 8-bit truecolor PNG."""
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[-1] != 3:
        raise ValueError(f"`image` must be a [H, W, 3] uint8 tensor, got {image.dtype} {list(image.shape)}")
    height, width, _ = image.shape
    rows = image.contiguous().view(height, width * 3)  # [H, 3W]: R, G, B of each pixel in turn
    raw = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), rows], dim=1)  # [H, 1 + 3W]: filter byte 0 per row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, no interlace
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(bytes(raw.flatten().tolist()), 9))  # [H * (1 + 3W)] bytes, row by row
        + chunk(b"IEND", b"")
    )
    with open(path, "wb") as f:
        f.write(png)
