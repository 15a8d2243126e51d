"""Step-through animations for the book: frames drawn with matplotlib, played offline.

:func:`step_through` turns a list of frames (ledger entries from :mod:`fa_lib.reference`'s traces)
and a drawing function into the HTML of a ``matplotlib.animation.FuncAnimation`` exported with
``to_jshtml``: every frame is an embedded PNG and the player (play, pause, step, slider) is inline
JavaScript, so it works in the built book with no Jupyter kernel and no network. Two things differ
from a plain ``to_jshtml()``:

* matplotlib's player links the Font Awesome stylesheet from a CDN; that ``<link>`` is removed (the
  book's theme ships Font Awesome itself, and each button also carries a ``title``), and the
  result is checked to hold no ``http(s)://`` address apart from XML namespaces;
* the HTML is wrapped in ``<div class="fa-stepthrough" data-frames="N">``, a marker that a test
  can find without relying on any stylesheet, and matplotlib's random element id is replaced by
  one derived from the content, so that re-running a notebook does not rewrite an unchanged
  animation;
* where no Font Awesome is loaded (a notebook opened offline in Jupyter), a small scoped style
  gives the buttons plain-text symbols instead of leaving them blank. In the book, the theme's
  Font Awesome script replaces each icon's ``<i>`` with an inline ``<svg>`` (whose ``xmlns`` is
  the only URL-like text in the player), so the style no longer applies.

The smallest text drawn in any frame, in pixels of the PNG, is recorded on the player's ``img`` as
``data-min-text-px`` (and on :class:`StepThrough` as ``min_text_px``): the book's stylesheet scales the
frame to the width of the text column, and a test multiplies that number by the scale to check that
the text a reader sees is at least 10 px. Text a drawing function leaves at matplotlib's default size
is drawn at ``font_pt`` points (11 unless given); give explicit sizes no smaller.

In the player, the step button is ``button[title="Next frame"]`` (``"Previous frame"``, ``"Play"``,
``"Pause"`` and the others likewise); the frame on screen is the ``src`` (a ``data:image/png``
URI) of the ``img`` whose id starts with ``_anim_img``, and the slider ``input.anim-slider`` holds
the current frame's index.

matplotlib is imported when :func:`step_through` is called: it belongs to fa_lib's ``book`` extra,
not to what the kernels need.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["CSS_CLASS", "STEP_BUTTON", "StepThrough", "frame_count", "remote_urls", "step_through"]

CSS_CLASS = "fa-stepthrough"
STEP_BUTTON = 'button[title="Next frame"]'  # a CSS selector for the player's step button

_MODES = ("once", "loop", "reflect")
_CDN_LINK = re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"']?(?:https?:)?//[^>]*>\s*", re.IGNORECASE)
_URL = re.compile(r"(?:https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]{2,}[^\s\"'<>)]*", re.IGNORECASE)
_XMLNS = re.compile(r"\bxmlns(?::\w+)?\s*=\s*[\"'][^\"']*[\"']", re.IGNORECASE)
_FRAMES = re.compile(r"var frames = new Array\((\d+)\);")
# Plain-text symbols for matplotlib's Font Awesome 4 icons, used only while an icon is still an
# empty <i> (Font Awesome's script replaces it with an <svg>); U+FE0E asks for text, not emoji.
_FALLBACK_STYLE = """<style>
.{css} .anim-buttons i.fa:empty::before {{ font-style: normal; }}
.{css} .anim-buttons i.fa-minus:empty::before {{ content: "\\2212"; }}
.{css} .anim-buttons i.fa-plus:empty::before {{ content: "+"; }}
.{css} .anim-buttons i.fa-fast-backward:empty::before {{ content: "\\21E4"; }}
.{css} .anim-buttons i.fa-fast-forward:empty::before {{ content: "\\21E5"; }}
.{css} .anim-buttons i.fa-step-backward:empty::before {{ content: "\\2039"; }}
.{css} .anim-buttons i.fa-step-forward:empty::before {{ content: "\\203A"; }}
.{css} .anim-buttons i.fa-pause:empty::before {{ content: "\\275A\\275A"; }}
.{css} .anim-buttons i.fa-play:empty::before {{ content: "\\25B6\\FE0E"; }}
.{css} .anim-buttons i.fa-play.fa-flip-horizontal:empty::before {{ content: "\\25C0\\FE0E"; }}
</style>"""


@dataclass(frozen=True)
class StepThrough:
    """An offline step-through animation: ``html`` (a self-contained fragment, wrapped in
    ``<div class="fa-stepthrough">``), ``n_frames``, the number of frames it holds, and
    ``min_text_px``, the height in PNG pixels of the smallest text drawn in any frame."""

    html: str
    n_frames: int
    min_text_px: float = 0.0

    def _repr_html_(self) -> str:
        return self.html


def remote_urls(html: str) -> list:
    """Every ``http(s)://`` or protocol-relative address in ``html``, XML namespaces excepted."""
    return _URL.findall(_XMLNS.sub("", html))


def frame_count(html: str) -> int:
    """The number of frames a ``to_jshtml`` player holds (``var frames = new Array(N)``)."""
    found = _FRAMES.findall(html)
    if len(found) != 1:
        raise ValueError(f"expected one to_jshtml player in the HTML, found {len(found)}")
    return int(found[0])


def step_through(
    frames: Sequence[Any],
    draw: Callable[[Any, Any, int], None],
    *,
    figsize: tuple = (8.0, 3.0),
    dpi: int = 72,
    interval_ms: int = 1500,
    default_mode: str = "once",
    embed_limit_mb: float = 1.5,
    font_pt: float = 11.0,
) -> StepThrough:
    """An offline step-through of ``frames``: one picture per frame, drawn by ``draw``.

    ``draw(fig, frame, index)`` draws one frame on the cleared figure ``fig`` (add axes to it;
    ``index`` counts from 0). The frames are rendered at ``dpi`` into PNGs of ``figsize`` inches and
    embedded in the returned :class:`StepThrough`; ``interval_ms`` is the time per frame when
    playing, ``default_mode`` what the player does at the last frame (``"once"``, ``"loop"`` or
    ``"reflect"``). ``embed_limit_mb`` caps the embedded frames: an animation that would exceed it
    raises ``ValueError`` (matplotlib would silently drop the frames past the limit) -- lower the dpi,
    shrink the figure or use fewer frames. ``font_pt`` is the size of text drawn without an explicit
    size (tick labels, titles, legends); the player scales the frame to the width of its column, so
    text of ``font_pt`` points in a figure ``figsize[0]`` inches wide is shown at
    ``font_pt / 72 * column_width / figsize[0]`` pixels.
    """
    frames = list(frames)
    if not frames:
        raise ValueError("frames must hold at least one frame")
    if not callable(draw):
        raise TypeError(f"draw must be a function draw(fig, frame, index), got {type(draw).__name__}")
    if default_mode not in _MODES:
        raise ValueError(f"default_mode must be one of {_MODES}, got {default_mode!r}")
    if isinstance(dpi, bool) or not isinstance(dpi, int) or dpi < 10:
        raise ValueError(f"dpi must be an int >= 10, got {dpi!r}")
    if isinstance(interval_ms, bool) or not isinstance(interval_ms, int) or interval_ms < 1:
        raise ValueError(f"interval_ms must be a positive int, got {interval_ms!r}")
    if not embed_limit_mb > 0:
        raise ValueError(f"embed_limit_mb must be positive, got {embed_limit_mb!r}")
    if isinstance(font_pt, bool) or not isinstance(font_pt, (int, float)) or not font_pt > 0:
        raise ValueError(f"font_pt must be a positive number, got {font_pt!r}")

    import matplotlib as mpl
    import matplotlib.pyplot as plt
    from matplotlib.animation import FuncAnimation

    from matplotlib.text import Text

    sizes = {
        "font.size": font_pt, "axes.titlesize": font_pt + 1, "axes.labelsize": font_pt,
        "xtick.labelsize": font_pt, "ytick.labelsize": font_pt, "legend.fontsize": font_pt,
        "figure.titlesize": font_pt + 1,
    }
    smallest = []  # the smallest text size, in points, of each frame drawn

    def text_sizes(figure):
        for text in figure.findobj(Text):
            if text.get_visible() and text.get_text().strip():
                yield text.get_fontsize()

    fig_context = mpl.rc_context(sizes)
    fig_context.__enter__()
    fig = plt.figure(figsize=figsize, dpi=dpi)
    try:

        def update(index):
            # the text of the frame drawn last, tick labels included (they exist once drawn)
            smallest.append(min(text_sizes(fig), default=float("inf")))
            fig.clear()
            draw(fig, frames[index], index)
            return []

        anim = FuncAnimation(
            fig, update, frames=len(frames), init_func=lambda: [], interval=interval_ms,
            repeat=default_mode != "once", blit=False,
        )
        # embed_limit counts the base64 text of the frames, in MiB; the warning that matplotlib logs
        # when it is reached is turned into an error below.
        with mpl.rc_context({"animation.embed_limit": embed_limit_mb, "savefig.dpi": dpi}):
            raw = anim.to_jshtml(default_mode=default_mode)
        smallest.append(min(text_sizes(fig), default=float("inf")))  # the last frame
    finally:
        plt.close(fig)
        fig_context.__exit__(None, None, None)

    n = frame_count(raw)
    if n != len(frames):
        raise ValueError(
            f"only {n} of {len(frames)} frames fit in embed_limit_mb={embed_limit_mb}: lower the dpi, "
            "shrink figsize or use fewer frames"
        )
    html = _CDN_LINK.sub("", raw)
    # matplotlib names the player's elements with a random uuid4; a hash of the content instead
    ids = set(re.findall(r"_anim_img([0-9a-f]{32})", html))
    if len(ids) != 1:
        raise ValueError(f"expected one player id in matplotlib's HTML, found {len(ids)}")
    (random_id,) = ids
    stable_id = hashlib.sha256(html.replace(random_id, "").encode("utf8")).hexdigest()[:32]
    html = html.replace(random_id, stable_id)
    leftover = remote_urls(html)
    if leftover:
        raise ValueError(f"the animation's HTML still refers to the network: {leftover[:3]}")
    min_pt = min(smallest, default=float("inf"))
    min_px = round(min_pt * dpi / 72, 1) if min_pt != float("inf") else 0.0
    html = html.replace('<img id="_anim_img', f'<img data-min-text-px="{min_px}" id="_anim_img', 1)
    style = _FALLBACK_STYLE.format(css=CSS_CLASS)
    html = f'<div class="{CSS_CLASS}" data-frames="{n}">\n{style}\n{html}\n</div>'
    return StepThrough(html=html, n_frames=n, min_text_px=min_px)
