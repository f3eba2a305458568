"""The report's figures, drawn offline with matplotlib (Agg) and returned as ``data:image/png;base64`` URIs to
inline in the page: no file beside it, no network.

Colour means the same thing everywhere: error / budget on a log scale, blue within budget (below 1), white at
the budget, red beyond it. PNGs are quantized to a small palette, which keeps a figure around 10 KB.
"""

from __future__ import annotations

import base64
import collections
import functools
import io
import json
import math
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg", force=False)

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402

FLOOR = 1e-4          # ratios below this (and exact zeros) are drawn at the floor
DPI = 90
CMAP = "RdBu_r"
ANNOTATE_MAX_CELLS = 160


_drawn: "collections.OrderedDict[str, str]" = collections.OrderedDict()


def _memo(draw):
    """Identical figures (the same map drawn twice in a run) are drawn once; the last 64 are kept."""

    @functools.wraps(draw)
    def cached(*args, **kwargs):
        key = json.dumps([draw.__name__, args, kwargs], default=str)
        if key not in _drawn:
            _drawn[key] = draw(*args, **kwargs)
            if len(_drawn) > 64:
                _drawn.popitem(last=False)
        return _drawn[key]

    return cached


def _uri(fig: Figure) -> str:
    FigureCanvasAgg(fig)
    raw = io.BytesIO()
    fig.savefig(raw, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.06)
    from PIL import Image

    image = Image.open(io.BytesIO(raw.getvalue())).convert("RGB")
    small = io.BytesIO()
    image.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(small, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(small.getvalue()).decode("ascii")


def _log(value: float) -> float:
    if not math.isfinite(value):
        return 12.0
    return math.log10(max(value, FLOOR))


def _ratio_text(value: float) -> str:
    if value == 0:
        return "0"
    if value >= 1000:
        return f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
    if value >= 10:
        return f"{value:.0f}"
    return f"{value:.2g}"


def ratio_colour(ratio: float) -> tuple:
    """(background, ink) hex colours of a ratio on the heatmaps' scale (the verdict tables use them)."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    value = _log(ratio)
    norm = TwoSlopeNorm(vmin=math.log10(FLOOR), vcenter=0.0, vmax=max(4.0, value))
    level = float(norm(value))
    background = colormaps[CMAP](0.5 + (level - 0.5) * 0.8)       # keep the extremes readable
    return to_hex(background), ("#ffffff" if abs(level - 0.5) > 0.33 else "#111111")


@_memo
def heatmap(matrix: Sequence[Sequence[float]], rows: Sequence[str], cols: Sequence[str], title: str,
            xlabel: str, ylabel: str) -> str:
    """A rows x cols heatmap of ratios (error / budget), cells annotated when the map is small."""
    nrows, ncols = len(matrix), len(matrix[0]) if matrix else 0
    logs = [[_log(v) for v in row] for row in matrix]
    top = max([max(r) for r in logs] + [1.0])
    norm = TwoSlopeNorm(vmin=math.log10(FLOOR), vcenter=0.0, vmax=max(top, 1.0))
    width = min(12.0, max(3.8, 2.0 + 0.5 * ncols))
    height = min(9.0, max(1.7, 1.0 + 0.3 * nrows))
    fig = Figure(figsize=(width, height))
    ax = fig.add_subplot()
    image = ax.imshow(logs, cmap=CMAP, norm=norm, aspect="auto", interpolation="nearest")
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    step_x = max(1, math.ceil(ncols / 24))
    ax.set_xticks(range(0, ncols, step_x), [cols[i] for i in range(0, ncols, step_x)], fontsize=7)
    step_y = max(1, math.ceil(nrows / 32))
    ax.set_yticks(range(0, nrows, step_y), [rows[i] for i in range(0, nrows, step_y)], fontsize=7)
    if nrows * ncols <= ANNOTATE_MAX_CELLS:
        for r in range(nrows):
            for c in range(ncols):
                v = matrix[r][c]
                ax.text(c, r, _ratio_text(v), ha="center", va="center", fontsize=7,
                        color="white" if abs(logs[r][c]) > 0.6 * max(top, 4) else "black")
    bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    bar.set_label("error / budget", fontsize=7)
    # Ticks beyond the norm's range break a TwoSlopeNorm colour bar: keep them inside it.
    ticks = [t for t in range(math.floor(math.log10(FLOOR)), math.floor(norm.vmax) + 1)
             if t % max(1, math.ceil((math.ceil(top) - math.log10(FLOOR)) / 6)) == 0]
    bar.set_ticks(ticks, labels=[f"1e{t}" if t else "1" for t in ticks])
    bar.ax.tick_params(labelsize=6)
    return _uri(fig)


@_memo
def sequence(profiles: Sequence[Sequence[float]], bin_width: int, chunk_size: int, seqlen: int, title: str,
             row_label: str = "batch row", segments: Optional[Sequence[Sequence[int]]] = None,
             padding: Optional[Sequence[int]] = None) -> str:
    """The largest ratio at each token, one line per row, with the budget (ratio 1), chunk boundaries (dotted),
    sequence boundaries (solid, one colour per row) and padding tokens (shaded) marked."""
    fig = Figure(figsize=(10.5, 2.6))
    ax = fig.add_subplot()
    colours = [f"C{i % 10}" for i in range(len(profiles))]
    top = FLOOR
    for i, row in enumerate(profiles):
        xs = [k * bin_width for k in range(len(row))] + [min(len(row) * bin_width, seqlen)]
        ys = [max(v, FLOOR) if math.isfinite(v) else 1e12 for v in row]
        ys = ys + ys[-1:]
        top = max([top] + ys)
        ax.step(xs, ys, where="post", color=colours[i], linewidth=1.1,
                label=f"{row_label} {i}" if len(profiles) > 1 else None)
    ax.set_yscale("log")
    ax.set_xlim(0, max(seqlen, 1))
    ax.set_ylim(FLOOR * 0.8, max(top * 3, 10.0))
    # Plain tick labels: matplotlib's default log labels go through mathtext, most of the drawing time.
    decades = range(round(math.log10(FLOOR)), math.ceil(math.log10(max(top * 3, 10.0))) + 1)
    step = max(1, math.ceil(len(decades) / 8))
    ticks = [d for d in decades if d % step == 0]
    ax.set_yticks([10.0 ** d for d in ticks], [f"1e{d}" if d else "1" for d in ticks])
    ax.yaxis.set_minor_locator(NullLocator())
    ax.axhline(1.0, color="#b2182b", linestyle="--", linewidth=1, label="budget (ratio 1)")
    for boundary in range(chunk_size, seqlen, chunk_size):
        ax.axvline(boundary, color="#999999", linestyle=":", linewidth=0.8)
    if segments is not None:
        pads = list(padding) if padding else [0] * len(segments)
        labelled = set()
        for i, lengths in enumerate(segments):
            start = 0
            for length in lengths[:-1]:
                start += length
                ax.axvline(start, color=colours[i % len(colours)], linewidth=1.4, linestyle="-.", alpha=0.7,
                           label=None if "boundary" in labelled else "sequence boundary")
                labelled.add("boundary")
            pad = pads[i] if i < len(pads) else 0
            if pad:
                ax.axvspan(seqlen - pad, seqlen, color=colours[i % len(colours)], alpha=0.12,
                           label=None if "padding" in labelled else "padding (not judged)")
                labelled.add("padding")
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_xlabel(f"token (dotted: chunk boundaries every {chunk_size})", fontsize=8)
    ax.set_ylabel("error / budget", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return _uri(fig)


__all__ = ["heatmap", "sequence"]
