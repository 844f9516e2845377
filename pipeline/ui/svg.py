"""Small inline SVG charts (no script, no external files): a line with an optional band, and bars."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Final

WIDTH: Final = 640
HEIGHT: Final = 200
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 12, 34


@dataclass(frozen=True)
class Scale:
    low: float
    high: float
    start: float
    end: float

    def __call__(self, value: float) -> float:
        span = self.high - self.low
        share = 0.5 if span == 0 else (value - self.low) / span
        return self.start + share * (self.end - self.start)


def _label(value: float) -> str:
    return f"{value:.4g}"


def _frame(x: Scale, y: Scale, xlabel: str, ylabel: str, body: list[str], title: str) -> str:
    bottom, middle = HEIGHT - BOTTOM, (LEFT + WIDTH - RIGHT) / 2
    axes = [
        f'<line x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" y2="{bottom}" class="axis"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}" class="axis"/>',
        f'<text x="{LEFT - 4}" y="{TOP + 8}" text-anchor="end">{_label(y.high)}</text>',
        f'<text x="{LEFT - 4}" y="{HEIGHT - BOTTOM}" text-anchor="end">{_label(y.low)}</text>',
        f'<text x="{LEFT}" y="{HEIGHT - BOTTOM + 14}">{_label(x.low)}</text>',
        f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - BOTTOM + 14}" text-anchor="end">{_label(x.high)}</text>',
        f'<text x="{middle}" y="{HEIGHT - 4}" text-anchor="middle">{escape(xlabel)}</text>',
        f'<text x="12" y="{(TOP + HEIGHT - BOTTOM) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 12 {(TOP + HEIGHT - BOTTOM) / 2})">{escape(ylabel)}</text>',
    ]
    return (
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{escape(title)}"><title>{escape(title)}</title>{"".join(axes)}{"".join(body)}</svg>'
    )


def line_chart(
    xs: Sequence[float],
    ys: Sequence[float],
    *,
    low: Sequence[float] | None = None,
    high: Sequence[float] | None = None,
    xlabel: str,
    ylabel: str,
    title: str,
) -> str:
    """A line through (x, y) with dots and, given ``low``/``high``, a shaded band between them."""
    if not xs:
        return '<p class="empty">nothing to plot yet</p>'
    band_values = [*(low or []), *(high or [])]
    y = Scale(min([*ys, *band_values]), max([*ys, *band_values]), HEIGHT - BOTTOM, TOP)
    x = Scale(min(xs), max(xs), LEFT + 6, WIDTH - RIGHT - 6)
    body = []
    if low is not None and high is not None:
        outline = [f"{x(a):.1f},{y(b):.1f}" for a, b in zip(xs, high, strict=True)]
        outline += [f"{x(a):.1f},{y(b):.1f}" for a, b in reversed(list(zip(xs, low, strict=True)))]
        body.append(f'<polygon class="band" points="{" ".join(outline)}"/>')
    points = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in zip(xs, ys, strict=True))
    body.append(f'<polyline class="line" points="{points}"/>')
    for a, b in zip(xs, ys, strict=True):
        body.append(
            f'<circle class="dot" cx="{x(a):.1f}" cy="{y(b):.1f}" r="2.5"><title>{_label(a)}: {_label(b)}'
            "</title></circle>"
        )
    return _frame(x, y, xlabel, ylabel, body, title)


def bar_chart(
    bars: Sequence[tuple[int, float]],
    *,
    slots: int,
    x_low: float,
    x_high: float,
    xlabel: str,
    ylabel: str,
    title: str,
) -> str:
    """Bars of (slot, height) among ``slots`` evenly spaced buckets that span ``x_low`` to ``x_high``."""
    if not bars:
        return '<p class="empty">nothing to plot yet</p>'
    slots = max(slots, 1)
    y = Scale(0.0, max(max(height for _, height in bars), 1e-12), HEIGHT - BOTTOM, TOP)
    x = Scale(x_low, x_high, LEFT + 2, WIDTH - RIGHT - 2)
    step = (WIDTH - LEFT - RIGHT - 4) / slots
    body = [
        f'<rect class="bar" x="{LEFT + 2 + slot * step + 0.5:.1f}" y="{y(height):.1f}" '
        f'width="{max(step - 1, 0.5):.1f}" height="{y.start - y(height):.1f}">'
        f"<title>{_label(height)}</title></rect>"
        for slot, height in bars
    ]
    return _frame(x, y, xlabel, ylabel, body, title)
