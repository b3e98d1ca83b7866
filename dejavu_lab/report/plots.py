"""Figure helpers shared by the chapters: one colour per method, and captions that name model,
text, tokens and hardware.

Every figure in the book says what produced it (model, text, tokens, hardware); these put
:func:`~dejavu_lab.report.book.caption`'s line under a plotly figure or a matplotlib/seaborn axes
the same way in every chapter. :data:`COLORS` gives each sparsity method the same colour in the
explorer, the gated-MLP chapter's frontier and the engine's per-method timings.
"""

from __future__ import annotations

import textwrap

__all__ = [
    "COLORS",
    "caption_axes",
    "caption_figure",
    "dash",
    "legend_and_caption_below",
    "wrap_caption",
]

#: method -> its colour in every chapter ("predicted" is the explorer's name for DejaVu's sets)
COLORS = {
    "dense": "#444444",
    "oracle": "#2ca02c",
    "static": "#7f7f7f",
    "dejavu": "#d62728",
    "predicted": "#d62728",
    "cats": "#9467bd",
    "teal": "#1f77b4",
    "wina": "#ff7f0e",
    "larosa": "#17becf",
    "rsparse": "#8c564b",
}


def dash(variant: str) -> str:
    """A variant's line style beside its method's colour: dotted for a uniform allocation,
    dash-dot for a refit (:mod:`dejavu_lab.sparsify.refit`; long dash-dot with its shares
    tilted, :mod:`dejavu_lab.sparsify.refit_shares`), dashed for budgets per layer, solid
    otherwise.

    >>> dash("teal (uniform)"), dash("teal (greedy, layers)"), dash("larosa")
    ('dot', 'dash', 'solid')
    >>> dash("wina (greedy, layers, refit)"), dash("wina (greedy, layers, refit, tilted)")
    ('dashdot', 'longdashdot')
    """
    if "uniform" in variant:
        return "dot"
    if "tilted" in variant:
        return "longdashdot"
    if "refit" in variant:
        return "dashdot"
    return "dash" if "layers" in variant else "solid"


CAPTION_CHARS = 90  # characters per caption line that fit the book's text column at 10 pt


def wrap_caption(caption: str, width: int = CAPTION_CHARS) -> str:
    """Break each ``<br>``-separated line of a plotly caption at ``width`` characters.

    >>> wrap_caption("one two three<br>four", width=7)
    'one two<br>three<br>four'
    """
    return "<br>".join(
        "<br>".join(textwrap.wrap(line, width) or [""]) for line in caption.split("<br>")
    )


def caption_figure(fig, caption: str, height: int = 420):
    """Put ``caption`` under a plotly figure (returns the figure), its lines wrapped to the
    page width and the bottom margin grown to hold them (a top margin the figure set itself, for
    two-line panel titles under its title, is kept).

    >>> import plotly.graph_objects as go
    >>> fig = caption_figure(go.Figure(go.Bar(y=[3, 1])), "Model: tiny-opt. Hardware: CPU.")
    >>> fig.layout.annotations[0].text, fig.layout.height
    ('Model: tiny-opt. Hardware: CPU.', 420)
    """
    caption = wrap_caption(caption)
    lines = caption.count("<br>") + 1
    top = max(60, fig.layout.margin.t or 0)  # a figure that made room above keeps it
    fig.update_layout(height=height + 14 * max(0, lines - 2), margin=dict(t=top, b=62 + 14 * lines))
    fig.add_annotation(
        text=caption,
        xref="paper",
        yref="paper",
        x=0,
        y=-0.22,
        xanchor="left",
        yanchor="top",
        showarrow=False,
        align="left",
        font=dict(size=10),
    )
    return fig


def legend_and_caption_below(fig, caption: str, entries: int, plot: int = 300, per_row: int = 5):
    """Lay out a figure of ``plot`` pixels of panels with, below them, the x-axis titles, a
    horizontal legend of ``entries`` items (``per_row`` to a row, as many as fit the book's
    column) and the wrapped caption, each in its own band so none overlaps another; returns
    the figure.

    >>> import plotly.graph_objects as go
    >>> fig = legend_and_caption_below(go.Figure(go.Bar(y=[3, 1])), "Model: tiny-opt.", 9)
    >>> fig.layout.height, fig.layout.margin.b, round(fig.layout.annotations[0].y, 2)
    (495, 135, -0.37)
    """
    text = wrap_caption(caption, 120)
    axis, legend = 60, 26 * (1 + (entries - 1) // per_row)
    below = axis + legend + 13 * (text.count("<br>") + 1) + 10
    fig.update_layout(height=60 + plot + below, margin=dict(t=60, b=below, l=60, r=20),
                      legend=dict(orientation="h", yanchor="top", y=-axis / plot, x=0))  # fmt: skip
    fig.add_annotation(text=text, xref="paper", yref="paper", x=0, y=-(axis + legend) / plot,
                       yanchor="top", showarrow=False, font=dict(size=9), xanchor="left",
                       align="left")  # fmt: skip
    return fig


def caption_axes(ax, caption: str):
    """Put ``caption`` under a matplotlib / seaborn axes (returns the axes).

    >>> from matplotlib.figure import Figure
    >>> ax = caption_axes(Figure().subplots(), "Model: tiny-opt. Hardware: CPU.")
    >>> [text.get_text() for text in ax.figure.texts]
    ['Model: tiny-opt. Hardware: CPU.']
    """
    ax.figure.text(0.0, -0.02, caption, fontsize=8, va="top", wrap=True)
    return ax
