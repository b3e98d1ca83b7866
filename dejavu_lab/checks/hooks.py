"""Hook names and hook callbacks (:mod:`dejavu_lab.hooks`).

Unchecked, a callback that returns the wrong thing fails far from its cause: a list or a numpy
array as ``AttributeError: 'list' object has no attribute 'shape'``, a float64 tensor as a dtype
error inside ``F.linear`` of the next layer, a CPU tensor on a GPU model as a device error there.
Names that match nothing (an empty list, a predicate that is never true) return an empty cache
silently. Each is one sentence here: :class:`HookError` (a ``ValueError``) for callbacks,
``KeyError`` for names (as for a glob that matches nothing).
"""

from __future__ import annotations

import torch

from ..errors import HookError
from ..vocab import HOOK_POINTS

__all__ = ["HookError", "callback", "matched", "name_spec", "returned"]


def callback(fn, pattern: str) -> None:
    """A hook callback must be callable as ``fn(tensor, name)``.

    >>> callback(print, "blocks.*.mlp.hook_post")  # fine
    >>> callback("print", "blocks.*.mlp.hook_post")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.HookError: The hook for 'blocks.*.mlp.hook_post' is a str, not a ...
    """
    if not callable(fn):
        raise HookError(
            f"The hook for {pattern!r} is a {type(fn).__name__}, not a function; pass "
            "fn(tensor, name) returning None or a replacement tensor."
        )


def returned(out, t: torch.Tensor, name: str, writable: bool) -> torch.Tensor:
    """Check what a callback returned at ``name`` in place of activation ``t``; return it.

    >>> t = torch.zeros(1, 3, 8)
    >>> returned(t + 1, t, "blocks.0.hook_resid_pre", True).shape
    torch.Size([1, 3, 8])
    >>> returned(t.double(), t, "blocks.0.hook_resid_pre", True)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.HookError: A hook at blocks.0.hook_resid_pre returned dtype ...
    """
    if not writable:
        raise HookError(
            f"{name} is read-only; return None from a hook there (observe only), and replace "
            "activations at a writable point (dejavu_lab.hooks.WRITABLE)."
        )
    like = f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"
    if not isinstance(out, torch.Tensor):
        raise HookError(
            f"A hook at {name} returned a {type(out).__name__}; return None (keep the "
            f"activation) or a tensor of {like}."
        )
    if out.shape != t.shape:
        raise HookError(
            f"A hook at {name} returned shape {tuple(out.shape)}; it must keep {tuple(t.shape)}: "
            "return a tensor of the activation's shape (mask entries instead of dropping them)."
        )
    if out.dtype != t.dtype:
        raise HookError(
            f"A hook at {name} returned dtype {out.dtype} but the model runs in {t.dtype}; "
            f"return .to({t.dtype})."
        )
    if out.device != t.device:
        raise HookError(
            f"A hook at {name} returned a tensor on {out.device} but the model runs on "
            f"{t.device}; return .to('{t.device}')."
        )
    return out


def name_spec(names):
    """``names`` for :func:`dejavu_lab.hooks.run_with_cache`: None, a string, a predicate or
    a list of strings.

    >>> name_spec(["blocks.0.*", 3])
    Traceback (most recent call last):
    ...
    KeyError: "Hook names must be strings or globs such as 'blocks.0.mlp.hook_post', got 3; ..."
    """
    if names is None or callable(names) or isinstance(names, str):
        return names
    try:
        items = list(names)
    except TypeError:
        items = [names]
    for n in items:
        if not isinstance(n, str):
            raise KeyError(
                f"Hook names must be strings or globs such as 'blocks.0.mlp.hook_post', got {n!r}; "
                "pass such names, a list of them or a predicate on them."
            )
    return items


def matched(selected: list[str], names, arch) -> list[str]:
    """The names ``names`` resolved to; none at all is a ``KeyError`` saying what names exist.

    >>> from dejavu_lab.models import random_model
    >>> matched([], lambda n: "mlp_in" in n, random_model("tiny-opt").arch)
    Traceback (most recent call last):
    ...
    KeyError: "No hook point matches the predicate <lambda>; use names like 'blocks.0.mlp..."
    """
    if selected:
        return selected
    what = "the predicate " + getattr(names, "__name__", "") if callable(names) else repr(names)
    raise KeyError(
        f"No hook point matches {what}; use names like 'blocks.0.mlp.hook_post' "
        f"(layers 0..{arch.n_layers - 1}, points: {', '.join(HOOK_POINTS)})."
    )
