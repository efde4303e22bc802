"""Contact-map figure as a PNG, with a minimal PNG writer (zlib only, no plotting library)."""

from __future__ import annotations

import struct
import zlib

import torch

WHITE = (255, 255, 255)
GREEN = (0, 160, 60)
RED = (220, 30, 30)
DIAGONAL = (200, 200, 200)


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


def contact_panel(probs: torch.Tensor, contacts: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """One protein as ``[L, L, 3]`` uint8.

    Above the diagonal: predicted contact probability (white = 0 to dark blue = 1), with the
    top-L/5 long-range picks in green (true contact) or red (not a contact). Below the diagonal:
    the true contacts in black.
    """
    length = probs.shape[0]
    p = probs.float().clamp(0, 1)
    blue = torch.stack([255 * (1 - p), 255 * (1 - 0.8 * p), 255 * (1 - 0.45 * p)], dim=-1)  # [L, L, 3]
    truth = torch.where(contacts[..., None], torch.zeros(3), torch.tensor(WHITE, dtype=torch.float32))
    upper = torch.ones(length, length, dtype=torch.bool).triu(1)[..., None]
    panel = torch.where(upper, blue, truth)
    picks = top & upper[..., 0]
    panel[picks & contacts] = torch.tensor(GREEN, dtype=torch.float32)
    panel[picks & ~contacts] = torch.tensor(RED, dtype=torch.float32)
    idx = torch.arange(length)
    panel[idx, idx] = torch.tensor(DIAGONAL, dtype=torch.float32)
    return panel.round().to(torch.uint8)


def contact_figure(panels: list[torch.Tensor], scale: int = 4, margin: int = 8) -> torch.Tensor:
    """Panels side by side, each enlarged ``scale`` times, on a white background."""
    height = max(p.shape[0] for p in panels) * scale + 2 * margin
    width = sum(p.shape[1] * scale + margin for p in panels) + margin
    image = torch.full((height, width, 3), 255, dtype=torch.uint8)
    x = margin
    for panel in panels:
        big = panel.repeat_interleave(scale, dim=0).repeat_interleave(scale, dim=1)
        image[margin : margin + big.shape[0], x : x + big.shape[1]] = big
        x += big.shape[1] + margin
    return image
