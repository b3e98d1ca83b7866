"""TEAL's own decoder, timed beside ours: its gpt-fast fork and its sparse GEMV kernels (§5.1).

TEAL (Liu et al. 2024, *Training-Free Activation Sparsity in Large Language Models*) ships a
fork of gpt-fast whose Llama decoder reads, in each decode step, only the weight columns whose
input entry passes a threshold. :func:`bench_teal` builds that decoder from a TEAL checkout the
user points to (imported from its folder by :mod:`~dejavu_lab.bench.teal_import`, never
copied here) at one of our random-weight Llama
shapes (:data:`dejavu_lab.models.PRESETS`), sets its thresholds so each site keeps the asked
fraction, and times its decode step compiled as TEAL's ``generate.py`` compiles it
(``torch.compile(mode="reduce-overhead", fullgraph=True)``, math attention, coordinate-descent
tuning), so ``kernels/bench_engine.py --peer-teal DIR`` records ours and TEAL's in one run.

How TEAL holds its sparsity (``gpt-fast/model.py`` and ``generate.py`` at commit 5baaec8):
each layer's ``Attention`` carries one float threshold per projection (``thresh_q/k/v``, all
three read the input of W_QKV; ``thresh_o``) and ``FeedForward`` ``thresh_gate/up`` (the
input of W_gate and W_up) and ``thresh_down``; its kernels sit in ``gemv1``/``gemv2``
(``torch.ops.teal.*``: a split-K Triton GEMV over column-major weights that loads column i only
where ``|x_i| > threshold``, in one-token steps; prefill stays dense), and
``apply_monkeypatch()`` switches the forward to them. ``generate.py`` reads each threshold off
a recorded histogram of the signed activation, ``icdf(0.5 + s/2)``. Random weights have no
recorded histogram; here the prompt is prefilled, then 16 dense one-token steps run, and a
hook on each site's input gathers what those steps feed it; the site's threshold lies halfway
between the k-th and (k+1)-th smallest ``|x|`` of those n entries, k = round(s·n)
(:func:`threshold_for`: exactly s of them fall under it). One-token inputs, not the prefill's:
at ``o_in`` the prefill's early positions, attending to few tokens, give larger entries, and
thresholds taken there keep less in decode steps (a 6-layer d = 1024 random model, prompt 512,
50%: 0.36 kept at layer 0's ``o_in``, 0.45 over its layers; our engine's
:func:`~dejavu_lab.engine.calibrate_thresholds` takes the prefill's). Each row records what
TEAL's kernels then keep over 8 eager decode steps (``kept_mean``, ``kept_min``, ``kept_max``
over the sites), counted on the inputs and thresholds the kernels receive (the same shape,
prompt 256, 50%: 0.48-0.51 at every site).

The sampled token is the greedy choice, as in our engine (``generate.py`` samples top-200 at
temperature 0.8). On torch ≥ 2.4 the token a CUDA-graph replay returns is cloned before it is
fed back (upstream gpt-fast does so too). TEAL's kernel wrapper needs ``msgspec``.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import torch

from ..errors import InputError
from .teal_import import load_teal, teal_args
from .timing import cuda, timed

__all__ = ["bench_teal", "print_peer_table", "threshold_for"]

ENGINE = "teal_peer"  # the rows' engine
# (layer attribute, Linear read, kernel attribute, our site name): the four sites per layer
SITES = (("attention", "wqkv", "gemv1", "attn_in"), ("attention", "wo", "gemv2", "o_in"),
         ("feed_forward", "w1", "gemv1", "mlp_in"), ("feed_forward", "w2", "gemv2", "down_in"))  # fmt: skip
CAL_STEPS = 16  # dense one-token steps whose site inputs set the thresholds
KEPT_STEPS = 8  # eager decode steps over which the kept fractions are counted


def threshold_for(values: torch.Tensor, sparsities) -> list[float]:
    """For each sparsity s, the threshold t with exactly round(s·n) of ``values``' n magnitudes
    at or under it (halfway between the two neighbouring sorted magnitudes, in fp32: the
    comparison TEAL's kernels make, ``|x| > t``); -1 keeps everything at s = 0.

    >>> x = torch.tensor([0.1, -0.4, 0.3, -0.2], dtype=torch.float16)
    >>> t = threshold_for(x, [0.0, 0.5, 0.75])
    >>> [round(v, 3) for v in t], [(x.abs().float() > v).float().mean().item() for v in t]
    ([-1.0, 0.25, 0.35], [1.0, 0.5, 0.25])
    """
    a = values.detach().abs().float().flatten().sort().values
    out = []
    for s in sparsities:
        k = round(s * a.numel())
        out.append(-1.0 if k == 0 else float((a[k - 1] + a[min(k, a.numel() - 1)]) / 2))
    return out


def _build(teal, preset, max_seq_len: int, device: str, seed: int = 0):
    """TEAL's ``Transformer`` at ``preset``'s shape, fp16 weights N(0, 0.02) and unit norms
    (as :func:`dejavu_lab.bench.engine.build` fills ours), its caches sized for ``max_seq_len``."""
    with torch.device("meta"):
        model = teal.model.Transformer(teal.model.ModelArgs(**teal_args(preset, max_seq_len)))
    model = model.to(torch.float16).to_empty(device=device).eval()  # no fp32 copy anywhere
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)
    with torch.device(device):
        model.setup_caches(max_batch_size=1, max_seq_length=max_seq_len)
    return model


def _step(model, tok, pos):
    """One decode step as TEAL's ``decode_one_token``, the token chosen greedily: [1, 1]."""
    logits = model(tok, pos)
    return logits[:, -1].argmax(-1, keepdim=True).to(torch.int)


def _prefill(model, ids):
    return _step(model, ids, torch.arange(ids.shape[1], device=ids.device))


def _eager(model, ids, steps: int) -> None:
    """Prefill ``ids``, then ``steps`` eager decode steps."""
    with torch.no_grad():
        tok, p = _prefill(model, ids), ids.shape[1]
        for t in range(steps):
            tok = _step(model, tok, torch.tensor([p + t], device=ids.device))


def _calibrate(model, ids, sparsities, steps: int = CAL_STEPS) -> dict[float, dict]:
    """{s: {(layer, site): threshold}} from ``steps`` dense one-token steps after the prefill
    of ``ids``: a hook on each site's Linear gathers its one-token inputs, the magnitudes the
    thresholds will meet (the prefill's own are larger at ``o_in``, where early positions
    attend to few tokens: thresholds taken there keep less in decode steps)."""
    seen, handles = {}, []
    for i, layer in enumerate(model.layers):
        for block, linear, _, site in SITES:

            def hook(_mod, args, key=(i, site)):
                if args[0].shape[1] == 1:
                    seen.setdefault(key, []).append(args[0].detach().flatten())

            handles.append(getattr(getattr(layer, block), linear).register_forward_pre_hook(hook))
    try:
        _eager(model, ids, steps)
    finally:
        for h in handles:
            h.remove()
    thr = {s: {} for s in sparsities}
    for key, xs in seen.items():
        for s, t in zip(sparsities, threshold_for(torch.cat(xs), sparsities), strict=True):
            thr[s][key] = t
    return thr


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_configs(teal) -> None:
    """On a CPU (``TRITON_INTERPRET=1``) the autotuner cannot time TEAL's tile configs: each
    kernel runs its first one."""
    for kernel in (teal.gemv.splitk_sparse_gemv_kernel, teal.gemv.qkv_kernel):
        kernel.configs = kernel.configs[:1]


def _sparsify(teal, model, thr: dict, device: str) -> None:
    """Switch every layer to TEAL's kernels with ``thr`` (what ``generate.py``'s
    ``monkeypatch_layer`` sets up from its histograms, one threshold per site here)."""
    dev, g = torch.device(device).type, teal.gemv
    if dev == "cpu":
        _interpreter_configs(teal)
    gemv = g.SparseGEMV.initialize("sparse_gemv", dev).operator(True)
    qkv = g.SparseQKVGEMV.initialize("sparse_qkv_gemv", dev).operator(True)
    for i, layer in enumerate(model.layers):
        a, f = layer.attention, layer.feed_forward
        a.gemv1, a.gemv2, f.gemv1, f.gemv2 = qkv, gemv, gemv, gemv
        a.thresh_q = a.thresh_k = a.thresh_v = thr[(i, "attn_in")]
        a.thresh_o = thr[(i, "o_in")]
        f.thresh_gate = f.thresh_up = thr[(i, "mlp_in")]
        f.thresh_down = thr[(i, "down_in")]
        a.sparsity_bin = f.sparsity_bin = 0
        for lin in (a.wqkv, a.wo, f.w1, f.w3, f.w2):  # the kernels read column-major weights
            lin.weight.data = lin.weight.data.T.contiguous().T
        a.apply_monkeypatch()
        f.apply_monkeypatch()


def _kept(model, ids, steps: int = KEPT_STEPS) -> dict:
    """{(layer, site): fraction of input entries TEAL's kernels keep} over ``steps`` eager
    decode steps: each kernel is called through a counter of ``|x| > threshold`` on what it
    receives (its one-token calls only), then put back."""
    counts, saved = {}, []

    def counter(op, key):
        def call(x, w, thr, *rest):
            if x.shape[1] == 1:
                counts.setdefault(key, []).append((x.abs().float() > thr).float().mean())
            return op(x, w, thr, *rest)

        return call

    for i, layer in enumerate(model.layers):
        for block, _, attr, site in SITES:
            mod = getattr(layer, block)
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, counter(getattr(mod, attr), (i, site)))
    try:
        _eager(model, ids, steps)
    finally:
        for mod, attr, op in saved:
            setattr(mod, attr, op)
    return {k: torch.stack(v).mean().item() for k, v in counts.items()}


def _time(model, ids, new_tokens: int, repeats: int, compile: bool) -> dict:
    """Median ms per decode step over ``repeats`` runs of ``new_tokens - 1`` steps (each after
    an untimed prefill), after one untimed run that compiles (``compile_s``: its extra seconds;
    ``cudagraph_skips``: compiled graphs that ran without CUDA graphs, 0 on a GPU when all is
    well)."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch._dynamo.reset()
    step = torch.compile(_step, mode="reduce-overhead", fullgraph=True, dynamic=False) if compile \
        else _step  # fmt: skip
    p, dev = ids.shape[1], ids.device

    def decode(tok):
        pos = torch.tensor([p], device=dev, dtype=torch.int)
        for _ in range(new_tokens - 1):
            with sdpa_kernel(SDPBackend.MATH):
                tok = step(model, tok.view(1, -1), pos).clone()  # a replay's output is reused
            pos += 1

    skips = counters["inductor"]["cudagraph_skips"]
    with torch.no_grad(), inductor.patch(coordinate_descent_tuning=True):
        t0 = time.perf_counter()
        decode(_prefill(model, ids))
        first = time.perf_counter() - t0
        prefill_ms = timed(lambda: _prefill(model, ids))
        runs = []
        for _ in range(repeats):
            tok = _prefill(model, ids)
            runs.append(timed(lambda: decode(tok)) / (new_tokens - 1))  # noqa: B023
    ms = statistics.median(runs)
    return {"ms_per_token": ms, "ms_per_token_runs": runs, "prefill_ms": prefill_ms,
            "compile_s": max(first - (ms * (new_tokens - 1) + prefill_ms) / 1e3, 0.0),
            # graphs inductor ran without CUDA graphs (0 when every replay is one graph)
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips}  # fmt: skip


def bench_teal(teal_dir, preset, prompts, new_tokens: int, sparsities, device: str, *,
               repeats: int = 3, compile: bool | None = None, rows: list | None = None) -> list:  # fmt: skip
    """Time TEAL's decoder at ``preset`` for each prompt and sparsity (0: its dense gpt-fast
    step, as ``generate.py`` without histograms): one row each (``kind: "peer"``, ``engine:
    "teal_peer"``), with ms per token (median of ``repeats``), prefill, compile seconds, the
    kept fractions counted on its kernels' inputs and TEAL's commit; appended to ``rows`` too.
    ``compile`` defaults to a GPU being there (on a CPU, eager under ``TRITON_INTERPRET=1``).
    A failure is recorded as a row with its ``error`` and the next one runs.

    >>> bench_teal("/no/such/dir", "llama-3-8b", [512], 64, [0.5], "cpu")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: /no/such/dir is not a TEAL checkout (it lacks gpt-fast/model.py, ...
    """
    teal = load_teal(teal_dir)
    vocab = teal_args(preset, 1)["vocab_size"]  # Llama shapes only, before any weight is built
    name = preset if isinstance(preset, str) else "custom"
    compile = (cuda() and device != "cpu") if compile is None else compile
    if torch.device(device).type == "cpu" and any(sparsities) and not _interpreting():
        raise InputError("TEAL's Triton kernels run on a CPU only under TRITON_INTERPRET=1; set "
                         "it before Python starts, or time TEAL on a GPU.")  # fmt: skip
    rows = [] if rows is None else rows
    base = {"kind": "peer", "model": name, "family": "llama", "engine": ENGINE,
            "teal_commit": teal.commit, "sampling": "greedy", "compiled": compile}  # fmt: skip
    for p in prompts:
        ids = torch.randint(0, vocab, (1, p), device=device)
        for s in sparsities:
            row = {**base, "prompt": p, "sparsity": s, "method": "teal" if s else "dense"}
            model = None
            try:
                model = _build(teal, preset, p + new_tokens, device)
                if s:
                    thr = _calibrate(model, ids, [s], min(CAL_STEPS, new_tokens - 1))[s]
                    _sparsify(teal, model, thr, device)
                    kept = _kept(model, ids, min(KEPT_STEPS, new_tokens - 1))
                    row.update(kept_mean=statistics.fmean(kept.values()),
                               kept_min=min(kept.values()), kept_max=max(kept.values()))  # fmt: skip
                row.update(_time(model, ids, new_tokens, repeats, compile))
                print(f"{name:>12} {ENGINE}@{s:.0%} prompt {p:5d}: {row['ms_per_token']:8.3f} "
                      f"ms/token, compile {row['compile_s']:.1f} s"
                      + (f", kept {row['kept_mean']:.3f}" if s else ""))  # fmt: skip
            except Exception as exc:  # record and go on, as bench_model does
                print(f"{name} {ENGINE}@{s:.0%} prompt {p} failed: {exc!r}")
                row["error"] = repr(exc)[:300]
            rows.append(row)
            del model
            torch._dynamo.reset()  # its graphs, and their CUDA-graph memory pool
            gc.collect()
            torch.cuda.empty_cache() if cuda() else None
    return rows


def print_peer_table(rows: list[dict]) -> None:
    """Ours beside TEAL's decoder: per model, prompt and sparsity, our ``dense``/``teal`` row's
    ms per token, TEAL's, and how many times faster ours is.

    >>> print_peer_table([
    ...     {"kind": "e2e", "engine": "teal", "method": "teal", "model": "m", "prompt": 8,
    ...      "sparsity": 0.5, "ms_per_token": 2.0},
    ...     {"kind": "peer", "engine": "teal_peer", "model": "m", "prompt": 8, "sparsity": 0.5,
    ...      "ms_per_token": 3.0}])
    <BLANKLINE>
    ours vs TEAL's own decoder (its gpt-fast fork and sparse GEMV kernels)
           model prompt sparsity  ours ms   TEAL ms  TEAL/ours
               m      8      50%     2.00      3.00       1.50
    """
    print("\nours vs TEAL's own decoder (its gpt-fast fork and sparse GEMV kernels)")
    print(f"{'model':>12} {'prompt':>6} {'sparsity':>8} {'ours ms':>8} {'TEAL ms':>9} "
          f"{'TEAL/ours':>10}")  # fmt: skip
    import pandas as pd  # here: the timing itself runs on images without pandas

    from ..report.peer import peer_table

    table = peer_table(pd.DataFrame(rows)) if rows else None  # the book's pairing, printed
    for r in [] if table is None else table.to_dict("records"):
        teal, mine = r["TEAL's decoder (ms)"], r["ours (ms)"]
        if teal != teal:  # NaN: a point only ours measured
            continue
        ours = f"{mine:8.2f}" if mine == mine else f"{'-':>8}"
        x = f"{r['TEAL / ours']:10.2f}" if mine == mine else f"{'-':>10}"
        print(f"{r['model']:>12} {int(r['prompt']):6d} {r['sparsity']:8.0%} {ours} "
              f"{teal:9.2f} {x}")  # fmt: skip
