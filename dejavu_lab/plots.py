"""Figure helpers shared by the chapters: captions that name model, text, tokens and hardware.

Every figure in the book says what produced it (STYLE.md); these put :func:`book.caption`'s
line under a plotly figure or a matplotlib/seaborn axes the same way in every chapter.
"""

from __future__ import annotations

__all__ = ["caption_axes", "caption_figure"]


def caption_figure(fig, caption: str, height: int = 420):
    """Put ``caption`` under a plotly figure (returns the figure).

    >>> import plotly.graph_objects as go
    >>> fig = caption_figure(go.Figure(go.Bar(y=[3, 1])), "Model: tiny-opt. Hardware: CPU.")
    >>> fig.layout.annotations[0].text, fig.layout.height
    ('Model: tiny-opt. Hardware: CPU.', 420)
    """
    fig.update_layout(height=height, margin=dict(t=60, b=90))
    fig.add_annotation(
        text=caption,
        xref="paper",
        yref="paper",
        x=0,
        y=-0.22,
        xanchor="left",
        yanchor="top",
        showarrow=False,
        font=dict(size=10),
    )
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
