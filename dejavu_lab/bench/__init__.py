"""What the GPU benchmarks in ``kernels/`` share: clocks, timed cases and the engine's variants.

The scripts in the repository's ``kernels/`` folder are thin (arguments, a loop, ``results.save``);
their reusable halves live here, one module each:

- :mod:`~dejavu_lab.bench.timing` — the clocks: CUDA-graph replay, the device-copy ceiling every
  bandwidth is divided by, relative errors;
- :mod:`~dejavu_lab.bench.kernels` — the sparse MLP and attention kernels timed against dense;
- :mod:`~dejavu_lab.bench.engine` — the decoder's variants (dense, DejaVu, TEAL, WINA, CATS) at
  random-weight shapes, their correctness checks and per-token timings (batch 1);
  :mod:`~dejavu_lab.bench.engine_variants` — those models, variants and the decoder of each;
- :mod:`~dejavu_lab.bench.engine_batch` — the same for the batch decoder;
- :mod:`~dejavu_lab.bench.teal_import` — TEAL's own decoder and kernels, imported from a
  checkout the user points to; :mod:`~dejavu_lab.bench.peer_teal` — that decoder at our shapes
  and kept fractions, timed beside ours.

Nothing in the package imports this layer except the book's live benchmark cells
(:mod:`dejavu_lab.report`).
"""
