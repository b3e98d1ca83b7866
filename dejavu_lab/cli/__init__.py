"""The ``dejavu-lab`` command line, one module per group of subcommands.

- :mod:`~dejavu_lab.cli.main`: the parser, the dispatch and the one-line errors (``main``, the
  console script; ``python -m dejavu_lab.cli`` runs it too);
- :mod:`~dejavu_lab.cli.args`: argument types checked while parsing, the shared options, loading
  a model and a corpus's windows;
- :mod:`~dejavu_lab.cli.perplexity`: ``perplexity``, dense or with any method;
- :mod:`~dejavu_lab.cli.predictors`: ``collect``, ``train-predictors``, ``eval``;
- :mod:`~dejavu_lab.cli.tasks`: ``eval-tasks`` (lm-evaluation-harness);
- :mod:`~dejavu_lab.cli.frontier`: ``frontier``, every method at every sparsity (resumable).
"""
