"""dejavu_lab: contextual sparsity in LLMs (Liu et al., "Deja Vu", ICML 2023), measured.

Modules, one idea each:

- loading: :mod:`assets` (pinned offline files), :mod:`models`, :mod:`arch` (per-family module
  tables), :mod:`corpus` (text, windows, perplexity);
- observing: :mod:`hooks` (TransformerLens-style activation hooks), :mod:`measure` (§3);
- sparsity: :mod:`budgets`, :mod:`sparsify` (every method), :mod:`collect`, :mod:`predictors`,
  :mod:`deferred_kv`, :mod:`bytes_model` (§4.1–4.2);
- speed: :mod:`step_bytes` (the bytes a decode step reads), :mod:`kernels` (Triton, §4.4),
  :mod:`engine` (§4.3, §5.1), :mod:`results` (recorded GPU runs with provenance);
- the book: :mod:`report` (every table, figure and widget: ``report.book``, ``report.plots``,
  ``report.explorer``, one module per chapter); the command line: :mod:`cli`.
"""

__version__ = "0.1.0"
