"""dejavu_lab: contextual sparsity in LLMs (Liu et al., "Deja Vu", ICML 2023), measured.

Modules, one idea each, in layers; a module imports only from its own layer and the ones listed before it
(``tests/test_layers.py`` checks it, imports inside functions included):

- words and errors: :mod:`vocab` (hook points, sites, the table of methods, formats),
  :mod:`errors` (every error type); :mod:`checks` (the boundary's input checks) reads only these;
- base: :mod:`atomic` (crash-safe files), :mod:`assets` (pinned offline files), :mod:`results`
  (recorded GPU runs with provenance), :mod:`staleness` (a recording's commit against the code
  here), :mod:`step_bytes` (the bytes a decode step reads);
- models and text: :mod:`arch` (per-family module tables), :mod:`gguf_cache` (GGUF files
  dequantised once, cached), :mod:`models`, :mod:`hooks`
  (TransformerLens-style activation hooks), :mod:`corpus` (text, windows, perplexity),
  :mod:`budgets` (kept counts per layer);
- sparsity: :mod:`collect`, :mod:`predictors`, :mod:`deferred_kv`, :mod:`bytes_model`,
  :mod:`sparsify` (every method, §4.1–4.2), :mod:`lm_eval_tasks`;
- the paper's observations: :mod:`measure` (§3);
- speed: :mod:`kernels` (Triton, §4.4), :mod:`engine` (§4.3, §5.1);
- faces: :mod:`bench` (what the GPU benchmarks share), :mod:`report` (every table, figure and
  widget of the book, one module per chapter), :mod:`cli` (the command line).
"""

__version__ = "0.1.0"
