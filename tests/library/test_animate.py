"""fa_lib.animate.step_through: an offline to_jshtml player, wrapped and checked."""
from __future__ import annotations

import re

import pytest

plt = pytest.importorskip("matplotlib.pyplot", reason="matplotlib is in fa_lib's book extra")

from fa_lib import animate  # noqa: E402


def _bars(fig, frame, index):
    ax = fig.add_subplot(1, 1, 1)
    ax.bar(range(len(frame)), frame)
    ax.set_title(f"frame {index}")


FRAMES = [[1, 0, 0], [1, 2, 0], [1, 2, 3]]


def test_player_holds_every_frame_and_the_marker():
    st = animate.step_through(FRAMES, _bars, figsize=(3, 2), dpi=40)
    assert st.n_frames == 3 == animate.frame_count(st.html)
    assert st.html.startswith(f'<div class="{animate.CSS_CLASS}" data-frames="3">')
    assert st.html.rstrip().endswith("</div>")
    assert st._repr_html_() == st.html
    assert 'title="Next frame"' in st.html and 'class="anim-slider"' in st.html
    assert len(re.findall(r'src="|data:image/png;base64,', st.html)) >= 3  # PNGs embedded


def test_player_is_offline():
    st = animate.step_through(FRAMES, _bars, figsize=(3, 2), dpi=40)
    assert "maxcdn" not in st.html and "<link" not in st.html
    assert animate.remote_urls(st.html) == []
    assert "http://" not in st.html and "https://" not in st.html


def test_html_is_deterministic_and_ids_differ_between_animations():
    a = animate.step_through(FRAMES, _bars, figsize=(3, 2), dpi=40)
    b = animate.step_through(FRAMES, _bars, figsize=(3, 2), dpi=40)
    c = animate.step_through(FRAMES[:2], _bars, figsize=(3, 2), dpi=40)
    assert a.html == b.html
    ids = {re.search(r"_anim_img(\w+)", x.html).group(1) for x in (a, c)}
    assert len(ids) == 2


def test_draw_gets_each_frame_in_order_and_the_figure_is_closed():
    seen = []

    def draw(fig, frame, index):
        seen.append((index, frame))
        fig.add_subplot(1, 1, 1).plot([0, 1], [0, frame])

    before = set(plt.get_fignums())
    animate.step_through([5, 6, 7, 8], draw, figsize=(2, 2), dpi=30, default_mode="loop")
    assert [s for s in seen if s[0] >= 0][-4:] == [(0, 5), (1, 6), (2, 7), (3, 8)]
    assert set(plt.get_fignums()) == before


def test_too_large_an_animation_raises_instead_of_dropping_frames():
    with pytest.raises(ValueError, match="fit in embed_limit_mb"):
        animate.step_through(FRAMES * 4, _bars, figsize=(6, 4), dpi=100, embed_limit_mb=0.01)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(frames=[]), ValueError, "at least one frame"),
        (dict(draw="not a function"), TypeError, "draw must be a function"),
        (dict(default_mode="bounce"), ValueError, "default_mode"),
        (dict(dpi=2.5), ValueError, "dpi"),
        (dict(interval_ms=0), ValueError, "interval_ms"),
        (dict(embed_limit_mb=0), ValueError, "embed_limit_mb"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = dict(frames=FRAMES, draw=_bars)
    args.update(kwargs)
    frames, draw = args.pop("frames"), args.pop("draw")
    with pytest.raises(error, match=match):
        animate.step_through(frames, draw, **args)


def test_remote_urls_and_frame_count():
    html = '<svg xmlns="http://www.w3.org/2000/svg"></svg><link href="https://cdn.example.com/x.css">'
    assert animate.remote_urls(html) == ["https://cdn.example.com/x.css"]
    assert animate.remote_urls('<svg xmlns="http://www.w3.org/2000/svg"/>') == []
    assert animate.frame_count("var frames = new Array(7);") == 7
    with pytest.raises(ValueError, match="found 0"):
        animate.frame_count("<div></div>")
