"""Every table, figure and widget of the book, one module per chapter or subject.

The compute packages (:mod:`dejavu_lab.engine`, :mod:`dejavu_lab.kernels`) import nothing from
here and no pandas or plotly, so they run on a bare GPU image; these modules read what they
measure (or what ``kernels/*.py`` recorded in ``results/``) and draw it.

- :mod:`~dejavu_lab.report.book` — what every chapter calls first: quick mode
  (:func:`~dejavu_lab.report.book.size`), figure set-up, captions;
- :mod:`~dejavu_lab.report.plots` — one colour per method (``COLORS``) and captions under a
  figure, for every chapter;
- :mod:`~dejavu_lab.report.source` — where a speed chapter's numbers come from (live, or a
  recording and its age), in captions and sentences;
- :mod:`~dejavu_lab.report.explorer` — the budget explorer (chapter 45);
- :mod:`~dejavu_lab.report.gated` — the quality side of the gated-MLP chapter (42): frontiers,
  thresholds, what each token kept;
- :mod:`~dejavu_lab.report.methods` — GPU time per token of every method in the engine
  (chapter 42);
- :mod:`~dejavu_lab.report.kernels` — the sparse kernels' bandwidth and speedups (chapter 60);
- :mod:`~dejavu_lab.report.int4` and :mod:`~dejavu_lab.report.int4_speed` — sparsity on 4-bit
  weights: bytes, perplexity, the budget box, and the int4 kernels' and engine's speed
  (chapter 65);
- :mod:`~dejavu_lab.report.engine` — end-to-end decoding latency and where a token's time goes
  (chapter 70);
- :mod:`~dejavu_lab.report.peer` — our decoder beside TEAL's own, from a recording of the
  engine benchmark's ``--peer-teal`` run (chapter 70);
- :mod:`~dejavu_lab.report.profile` — the decode step's GPU time per kernel inside its CUDA
  graph (chapter 70);
- :mod:`~dejavu_lab.report.batch` — batched decoding: throughput, unions and quality
  (chapter 75).

Import the module you need (``from dejavu_lab.report import book, plots``); nothing is
re-exported here.
"""
