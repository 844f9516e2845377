"""A small line chart as PNG, in pure Python (zlib): the demo's reward curve, without a plotting library."""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
GREY: Color = (200, 200, 200)
BLACK: Color = (40, 40, 40)
BLUE: Color = (31, 119, 180)
BAND: Color = (198, 219, 239)

# 3x5 digits and a few symbols for axis labels
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
}  # fmt: skip


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(WHITE) * width * height)

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for n in range(steps + 1):
            x = round(x0 + (x1 - x0) * n / steps)
            y = round(y0 + (y1 - y0) * n / steps)
            for dx in range(-(width // 2), width // 2 + 1):
                for dy in range(-(width // 2), width // 2 + 1):
                    self.set(x + dx, y + dy, color)

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 2) -> None:
        for k, char in enumerate(text):
            glyph = _GLYPHS.get(char)
            if glyph is None:
                continue
            for n, bit in enumerate(glyph):
                if bit == "1":
                    for sx in range(scale):
                        for sy in range(scale):
                            self.set(
                                x + k * 4 * scale + (n % 3) * scale + sx, y + (n // 3) * scale + sy, color
                            )

    def png(self) -> bytes:
        raw = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width])
            for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def line_chart(
    path: Path,
    xs: Sequence[float],
    ys: Sequence[float],
    *,
    low: Sequence[float] | None = None,
    high: Sequence[float] | None = None,
    width: int = 640,
    height: int = 360,
) -> Path:
    """Plot ys over xs (with an optional band low..high) to ``path``; y labels at the bottom and top."""
    canvas = Canvas(width, height)
    left, right, top, bottom = 60, width - 20, 20, height - 40
    y_values = [*ys, *(low or []), *(high or [])]
    y_min, y_max = min(y_values, default=0.0), max(y_values, default=1.0)
    if y_max - y_min < 1e-9:
        y_min, y_max = y_min - 0.5, y_max + 0.5
    x_min, x_max = min(xs, default=0.0), max(xs, default=1.0)
    x_span = max(x_max - x_min, 1e-9)

    def to_pixel(x: float, y: float) -> tuple[int, int]:
        px = left + (x - x_min) / x_span * (right - left)
        py = bottom - (y - y_min) / (y_max - y_min) * (bottom - top)
        return round(px), round(py)

    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = bottom - round(fraction * (bottom - top))
        canvas.line(left, y, right, y, GREY)
    if low is not None and high is not None:
        for x, lo, hi in zip(xs, low, high, strict=True):
            px, py_low = to_pixel(x, lo)
            _, py_high = to_pixel(x, hi)
            canvas.line(px, py_low, px, py_high, BAND, width=3)
    points = [to_pixel(x, y) for x, y in zip(xs, ys, strict=True)]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        canvas.line(x0, y0, x1, y1, BLUE, width=3)
    canvas.line(left, top, left, bottom, BLACK)
    canvas.line(left, bottom, right, bottom, BLACK)
    canvas.text(4, bottom - 5, f"{y_min:.2f}")
    canvas.text(4, top - 5, f"{y_max:.2f}")
    canvas.text(left, bottom + 12, f"{x_min:.0f}")
    canvas.text(right - 40, bottom + 12, f"{x_max:.0f}")
    path.write_bytes(canvas.png())
    return path
