"""dejavu_lab: contextual sparsity in LLMs (Liu et al., "Deja Vu", ICML 2023), measured.

Modules, one idea each: :mod:`assets` (pinned offline files), :mod:`models` (load a model),
:mod:`arch` (per-family module tables), :mod:`hooks` (TransformerLens-style activation hooks),
:mod:`corpus` (text, windows, perplexity), :mod:`plots` and :mod:`widgets` (figures, controls).
"""

__version__ = "0.1.0"
