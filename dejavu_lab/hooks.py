"""Activation hooks with TransformerLens-style names on unmodified Hugging Face models.

Every observation in the paper (§3, Fig. 2–5) is a statistic of a few activations per block.
This module exposes them under architecture-independent names, for layer ``i``:

==============================  ===============================================  ==========
name                            tensor                                           writable
==============================  ===============================================  ==========
blocks.{i}.hook_resid_pre       residual stream entering the block [b, p, d]     yes
blocks.{i}.attn.hook_z          per-head attention output before W_O [b,p,h,dh]  yes
blocks.{i}.attn.hook_result     per-head output after W_O (no bias) [b,p,h,d]    no
blocks.{i}.attn.hook_pattern    attention probabilities [b, h, q, k]             no
blocks.{i}.hook_attn_out        attention sub-block output (with bias) [b,p,d]   yes
blocks.{i}.hook_resid_mid       residual between attention and MLP [b, p, d]     no
blocks.{i}.mlp.hook_post        activation feeding W2 / down_proj [b, p, n]      yes
blocks.{i}.hook_mlp_out         MLP sub-block output [b, p, d]                   yes
blocks.{i}.hook_resid_post      residual stream leaving the block [b, p, d]      yes
blocks.{i}.ln1.hook_normalized  attention input, shared by q/k/v [b, p, d]       yes
blocks.{i}.ln2.hook_normalized  MLP input, shared by gate/up or fc1 [b, p, d]    yes
blocks.{i}.mlp.hook_pre         gate_proj / fc1 output before the act [b, p, n]  yes
==============================  ===============================================  ==========

The last three are where input-sparsity methods (TEAL, WINA, CATS; :mod:`dejavu_lab.sparsify`)
act. In pre-LN models ``ln1``/``ln2.hook_normalized`` are the outputs of the attention and MLP
norms; in post-LN OPT they are the tensors entering attention and fc1 (the previous norm's
output). Writing one changes only what the attention / the MLP reads, not the residual.

Only ``register_forward_hook`` / ``register_forward_pre_hook`` are used, inside a context manager
that removes them on exit, also when the forward raises. A hook callback ``fn(tensor, name)`` may
reduce the tensor on the spot (histograms, running sums) so that a long text never holds every
activation; a callback at a writable point may return a tensor to replace the activation (this is
how :mod:`dejavu_lab.sparsify` applies masks).

``resid_post == resid_pre + attn_out + mlp_out`` for pre-LN models; for post-LN OPT (350m) the
architecture's own norms sit between: ``resid_mid = LN_attn(resid_pre + attn_out)`` and
``resid_post = LN_mlp(resid_mid + mlp_out)``.

With sandwich norms (Gemma-3: a norm after each sub-block too) ``hook_attn_out`` and
``hook_mlp_out`` are the post-norms' outputs — what is added to the residual stream, so the
identity above holds — and ``attn.hook_result`` is each head's share of ``hook_attn_out``: the
post-norm is linear once its per-token RMS is fixed, so the heads' results still sum to it.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .arch import Arch, get_arch
from .checks import hooks as check_hooks
from .checks import tokens as check_tokens
from .vocab import HOOK_POINTS, WRITABLE

__all__ = ["HOOK_POINTS", "WRITABLE", "hook_names", "hooks", "run_with_cache", "run_with_hooks"]

_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")

HookFn = Callable[[torch.Tensor, str], torch.Tensor | None]


def hook_names(arch: Arch, points: Iterable[str] = HOOK_POINTS) -> list[str]:
    """All canonical names of a model, layer by layer.

    >>> from dejavu_lab.models import random_model
    >>> names = hook_names(random_model("tiny-opt").arch)
    >>> len(names), names[:2]  # 2 layers x 12 points
    (24, ['blocks.0.hook_resid_pre', 'blocks.0.attn.hook_z'])
    """
    return [f"blocks.{i}.{p}" for i in range(arch.n_layers) for p in points]


def _select(arch: Arch, names) -> list[str]:
    """Resolve ``names`` (None, a name, a glob, a list of them, or a predicate) to names."""
    every = hook_names(arch)
    names = check_hooks.name_spec(names)
    if names is None:
        return every
    if callable(names):
        return check_hooks.matched([n for n in every if names(n)], names, arch)
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for pat in names:
        hits = check_hooks.matched(fnmatch.filter(every, pat), pat, arch)
        out += [h for h in hits if h not in out]
    return check_hooks.matched(out, names, arch)


@contextmanager
def hooks(
    model: nn.Module,
    fwd_hooks: dict[str, HookFn] | Iterable[tuple[str, HookFn]],
    arch: Arch | None = None,
) -> Iterator[None]:
    """Attach callbacks at canonical hook points for the duration of a ``with`` block.

    ``fwd_hooks`` maps a name or a glob (``"blocks.*.mlp.hook_post"``) to ``fn(tensor, name)``.

    >>> from dejavu_lab.models import random_model
    >>> model = random_model("tiny-opt").model
    >>> seen = []
    >>> with hooks(model, {"blocks.*.mlp.hook_post": lambda t, name: seen.append(name)}):
    ...     _ = model(torch.tensor([[1, 2, 3]]))
    >>> seen  # the glob matched both layers
    ['blocks.0.mlp.hook_post', 'blocks.1.mlp.hook_post']
    """
    arch = arch or get_arch(model)
    items = fwd_hooks.items() if isinstance(fwd_hooks, dict) else fwd_hooks
    by_layer: dict[int, dict[str, list[HookFn]]] = {}
    for pat, fn in items:
        check_hooks.callback(fn, pat)
        for name in _select(arch, pat):
            i, point = _split(name)
            by_layer.setdefault(i, {}).setdefault(point, []).append(fn)
    handles: list = []
    restore_attn = None
    if any("attn.hook_pattern" in pts for pts in by_layer.values()):
        current = getattr(model.config, "_attn_implementation", "eager")
        if current != "eager":  # only eager attention materialises the probabilities
            model.set_attn_implementation("eager")
            restore_attn = current
    try:
        for i, points in by_layer.items():
            handles += _attach(model, arch, i, points)
        yield
    finally:
        for h in handles:
            h.remove()
        if restore_attn is not None:
            model.set_attn_implementation(restore_attn)


def run_with_hooks(
    model, input_ids: torch.Tensor, fwd_hooks, arch: Arch | None = None, **forward_kwargs
) -> torch.Tensor:
    """One forward pass with callbacks attached; returns the logits [b, p, vocab].

    A callback at a writable point that returns a tensor replaces the activation:

    >>> from dejavu_lab.models import random_model
    >>> model = random_model("tiny-llama").model
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> no_mlp = run_with_hooks(model, ids, {"blocks.*.mlp.hook_post": lambda t, n: 0 * t})
    >>> no_mlp.shape, torch.allclose(no_mlp, model(ids).logits)
    (torch.Size([1, 3, 128]), False)
    """
    input_ids = input_ids if input_ids is None else check_tokens.token_ids(input_ids, model)
    with torch.no_grad(), hooks(model, fwd_hooks, arch):
        return model(input_ids=input_ids, **forward_kwargs).logits


def run_with_cache(
    model,
    input_ids: torch.Tensor,
    names=None,
    arch: Arch | None = None,
    device: str | torch.device | None = None,
    **forward_kwargs,
):
    """Forward ``input_ids`` and return ``(logits, cache)``, cache a dict name -> tensor.

    ``names``: None (everything), a name, a glob, a list of these, or a predicate on names.
    ``device``: where to keep cached tensors (e.g. "cpu" when the model runs on a GPU).

    >>> from dejavu_lab.models import random_model
    >>> model, _, arch = random_model("tiny-llama")
    >>> logits, cache = run_with_cache(model, torch.tensor([[1, 2, 3]]), "blocks.0.attn.hook_z")
    >>> tuple(cache["blocks.0.attn.hook_z"].shape)  # [batch, pos, head, d_head]
    (1, 3, 4, 16)
    """
    arch = arch or get_arch(model)
    cache: dict[str, torch.Tensor] = {}

    def store(t: torch.Tensor, name: str) -> None:
        cache[name] = t.detach().to(device) if device is not None else t.detach().clone()

    selected = _select(arch, names)
    logits = run_with_hooks(
        model, input_ids, [(n, store) for n in selected], arch, **forward_kwargs
    )
    return logits, {n: cache[n] for n in selected if n in cache}


# ---------------------------------------------------------------------------------------------
# wiring: each point becomes a torch pre- or forward hook on one module of layer i


def _split(name: str) -> tuple[int, str]:
    m = _NAME.match(name)
    return int(m.group(1)), m.group(2)


def _call(fns: list[HookFn], t: torch.Tensor, name: str, point: str) -> torch.Tensor | None:
    """Run callbacks in order; a returned tensor replaces ``t`` for the next and the model."""
    replaced = None
    for fn in fns:
        out = fn(t, name)
        if out is not None:
            t = replaced = check_hooks.returned(out, t, name, point in WRITABLE)
    return replaced


def _attach(model: nn.Module, arch: Arch, i: int, points: dict[str, list[HookFn]]) -> list:
    arch.check(model, layers=[i])  # a table on a layer it does not describe: refuse
    layer = arch.layer(model, i)
    o_proj = arch.part(model, i, "o")
    mlp_out = arch.part(model, i, "mlp_out")
    # sandwich norms (Gemma-3): the sub-block outputs added to the residual are these norms'
    post_attn = arch.part(model, i, "ln_attn_post") if arch.sandwich else None
    post_mlp = arch.part(model, i, "ln_mlp_post") if arch.sandwich else None
    stash: dict[str, torch.Tensor] = {}  # z of the current call, for hook_result after a post-norm
    shape: dict[str, torch.Size] = {}  # [b, p, d] of the current call, for OPT's flattened MLP
    name = f"blocks.{i}."
    handles = []

    def want(p: str) -> list[HookFn] | None:
        return points.get(p)

    def layer_pre(mod, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        shape["x"] = hidden.shape
        if fns := want("hook_resid_pre"):
            new = _call(fns, hidden, name + "hook_resid_pre", "hook_resid_pre")
            if new is not None:
                if args:
                    return (new, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": new}
        return None

    handles.append(layer.register_forward_pre_hook(layer_pre, with_kwargs=True))

    def unflat(t: torch.Tensor) -> torch.Tensor:
        return t.view(*shape["x"][:-1], t.shape[-1]) if t.dim() == 2 else t

    if want("attn.hook_z") or want("attn.hook_result"):

        def o_pre(mod, args):
            x = args[0]  # [b, p, h*dh]
            z = x.view(*x.shape[:-1], arch.n_heads, arch.d_head)
            new = None
            if fns := want("attn.hook_z"):
                new = _call(fns, z, name + "attn.hook_z", "attn.hook_z")
                z = new if new is not None else z
            if (fns := want("attn.hook_result")) and post_attn is not None:
                stash["z"] = z  # the post-norm's scale is known only after W_O (result_fwd)
            elif fns:
                w = mod.weight.view(mod.out_features, arch.n_heads, arch.d_head)
                result = torch.einsum("...hk,ohk->...ho", z, w)
                _call(fns, result, name + "attn.hook_result", "attn.hook_result")
            if new is not None:
                return (new.reshape(x.shape), *args[1:])
            return None

        handles.append(o_proj.register_forward_pre_hook(o_pre))

    if post_attn is not None and want("attn.hook_result"):

        def result_fwd(mod, args, output):  # args[0]: W_O's output [b, p, d], before the norm
            z = stash.pop("z")
            w = o_proj.weight.view(o_proj.out_features, arch.n_heads, arch.d_head)
            scale = arch.post_norm_scale(mod, args[0])[..., None, :]  # [b, p, 1, d]
            result = (torch.einsum("...hk,ohk->...ho", z, w).float() * scale).to(z.dtype)
            _call(want("attn.hook_result"), result, name + "attn.hook_result", "attn.hook_result")

        handles.append(post_attn.register_forward_hook(result_fwd))

    attn_out_at_attn = want("hook_attn_out") and post_attn is None
    if want("attn.hook_pattern") or attn_out_at_attn:

        def attn_fwd(mod, args, output):
            out, weights = (output[0], output[1]) if isinstance(output, tuple) else (output, None)
            if fns := want("attn.hook_pattern"):
                if weights is None:
                    raise RuntimeError(
                        f"Layer {i} returned no attention probabilities; load the model with "
                        "attn_implementation='eager' to observe attn.hook_pattern."
                    )
                _call(fns, weights, name + "attn.hook_pattern", "attn.hook_pattern")
            if attn_out_at_attn:
                new = _call(want("hook_attn_out"), out, name + "hook_attn_out", "hook_attn_out")
                if new is not None:
                    return (new, *output[1:]) if isinstance(output, tuple) else new
            return None

        handles.append(arch.part(model, i, "attn").register_forward_hook(attn_fwd))

    if post_attn is not None and want("hook_attn_out"):

        def post_attn_fwd(mod, args, output):
            return _call(want("hook_attn_out"), output, name + "hook_attn_out", "hook_attn_out")

        handles.append(post_attn.register_forward_hook(post_attn_fwd))

    if want("hook_resid_mid"):
        if arch.pre_ln:  # the input of the MLP's norm is the residual after attention

            def mid_pre(mod, args):
                _call(
                    want("hook_resid_mid"),
                    unflat(args[0]),
                    name + "hook_resid_mid",
                    "hook_resid_mid",
                )

            handles.append(arch.part(model, i, "ln_mlp").register_forward_pre_hook(mid_pre))
        else:  # post-LN: the attention norm's output is the residual

            def mid_fwd(mod, args, output):
                _call(
                    want("hook_resid_mid"),
                    unflat(output),
                    name + "hook_resid_mid",
                    "hook_resid_mid",
                )

            handles.append(arch.part(model, i, "ln_attn").register_forward_hook(mid_fwd))

    if want("mlp.hook_post"):

        def post_pre(mod, args):
            x = args[0]
            new = _call(want("mlp.hook_post"), unflat(x), name + "mlp.hook_post", "mlp.hook_post")
            return None if new is None else (new.reshape(x.shape), *args[1:])

        handles.append(mlp_out.register_forward_pre_hook(post_pre))

    if want("hook_mlp_out"):

        def mlp_fwd(mod, args, output):
            new = _call(want("hook_mlp_out"), unflat(output), name + "hook_mlp_out", "hook_mlp_out")
            return None if new is None else new.reshape(output.shape)

        handles.append((post_mlp or mlp_out).register_forward_hook(mlp_fwd))

    if want("hook_resid_post"):

        def layer_fwd(mod, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            new = _call(
                want("hook_resid_post"), hidden, name + "hook_resid_post", "hook_resid_post"
            )
            if new is not None:
                return (new, *output[1:]) if isinstance(output, tuple) else new
            return None

        handles.append(layer.register_forward_hook(layer_fwd))
    handles += _attach_inputs(model, arch, i, points, unflat)
    return handles


def _attach_inputs(model: nn.Module, arch: Arch, i: int, points, unflat) -> list:
    """The linear layers' inputs: ln1/ln2.hook_normalized and mlp.hook_pre."""
    name = f"blocks.{i}."
    handles = []

    def first_arg(fns, point: str):  # a pre-hook replacing a module's first input
        def pre(mod, args, kwargs):
            key = None if args else ("hidden_states" if "hidden_states" in kwargs else "x")
            x = args[0] if args else kwargs[key]
            new = _call(fns, unflat(x), name + point, point)
            if new is None:
                return None
            new = new.reshape(x.shape)
            if args:
                return (new, *args[1:]), kwargs
            return args, {**kwargs, key: new}

        return pre

    if fns := points.get("ln1.hook_normalized"):  # what attention reads (q, k, v)
        attn = arch.part(model, i, "attn")
        handles.append(
            attn.register_forward_pre_hook(first_arg(fns, "ln1.hook_normalized"), with_kwargs=True)
        )
    if fns := points.get("ln2.hook_normalized"):  # what the MLP reads (gate/up, or fc1)
        mlp = arch.layer(model, i).get_submodule(arch.table.mlp) if arch.table.mlp else None
        target = mlp if mlp is not None else arch.mlp_in(model, i)[0]
        handles.append(
            target.register_forward_pre_hook(
                first_arg(fns, "ln2.hook_normalized"), with_kwargs=True
            )
        )
    if fns := points.get("mlp.hook_pre"):  # gate_proj / fc1 output, before the activation

        def pre_fwd(mod, args, output):
            new = _call(fns, unflat(output), name + "mlp.hook_pre", "mlp.hook_pre")
            return None if new is None else new.reshape(output.shape)

        handles.append(arch.mlp_in(model, i)[0].register_forward_hook(pre_fwd))
    return handles
