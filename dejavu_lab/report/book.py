"""Helpers every chapter notebook calls: quick mode, figure set-up, captions.

Each chapter takes its size from a parameters cell written with :func:`size`, so the test suite
can execute every chapter in seconds (``DEJAVU_QUICK=1``) while ``make book`` runs it full size.
"""

from __future__ import annotations

import os
import platform
import re

import torch

__all__ = ["QUICK_ENV", "caption", "hardware", "is_quick", "setup", "size"]

QUICK_ENV = "DEJAVU_QUICK"  # set to 1 to shrink every chapter (tests do)


def is_quick() -> bool:
    """Whether ``$DEJAVU_QUICK`` asks for quick mode (any value but empty, 0 or false).

    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {QUICK_ENV: "1"}):
    ...     is_quick()
    True
    """
    return os.environ.get(QUICK_ENV, "0") not in ("", "0", "false", "False")


def size(full, quick):
    """``full`` in the book, ``quick`` when ``DEJAVU_QUICK=1`` (the test suite).

    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {QUICK_ENV: "1"}):
    ...     size(full=512, quick=64)
    64
    """
    return quick if is_quick() else full


def setup() -> None:
    """Figure defaults: plotly figures that render in the static book, seaborn's theme.

    >>> import matplotlib, plotly.io as pio
    >>> saved = pio.renderers.default, pio.templates.default
    >>> with matplotlib.rc_context():  # undo seaborn's theme after the example
    ...     setup()
    >>> pio.renderers.default, pio.templates.default
    ('plotly_mimetype+offline_notebook', 'plotly_white')
    >>> pio.renderers.default, pio.templates.default = saved  # undo the rest
    """
    import plotly.io as pio
    import seaborn as sns
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one-second loads: no progress widgets in the page

    # the mimetype keeps the figure for JupyterLab; "offline_notebook" embeds plotly.js in the
    # page so the built HTML draws it with no network.
    pio.renderers["offline_notebook"] = _offline_notebook_renderer()
    pio.renderers.default = "plotly_mimetype+offline_notebook"
    pio.templates.default = "plotly_white"
    sns.set_theme(style="whitegrid", context="notebook")


def hardware() -> str:
    """What ran this: GPU name or CPU and core count.

    It names the GPU when one is visible (e.g. ``NVIDIA H200``), the CPU otherwise:

    >>> hardware().startswith("CPU (") != torch.cuda.is_available()
    True
    """
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    n = torch.get_num_threads()
    return f"CPU ({platform.machine()}, {n} thread{'' if n == 1 else 's'})"


def caption(model: str, text: str, n_tokens: int, extra: str = "") -> str:
    """One line naming the model, the text, the token count and the hardware of a figure.

    >>> caption("SmolLM2-135M", "Lee news corpus", 75264)
    'Model: SmolLM2-135M. Text: Lee news corpus, 75,264 tokens. Hardware: ...'
    """
    line = f"Model: {model}. Text: {text}, {n_tokens:,} tokens. Hardware: {hardware()}."
    return f"{line} {extra}".strip()


def _offline_notebook_renderer():
    """plotly's notebook renderer without its MathJax <script> from a CDN (figures use none)."""
    from plotly.io._base_renderers import NotebookRenderer

    cdn_script = re.compile(r'<script[^>]*src="https?://[^"]*mathjax[^"]*"[^>]*>\s*</script>', re.I)

    class OfflineNotebookRenderer(NotebookRenderer):
        def to_mimebundle(self, fig_dict):
            bundle = super().to_mimebundle(fig_dict)
            bundle["text/html"] = cdn_script.sub("", bundle["text/html"])
            return bundle

    return OfflineNotebookRenderer()
