"""Make Triton's CPU interpreter patch ``triton.language`` once per launch, not once per call.

Under ``TRITON_INTERPRET=1`` a kernel launch replaces ``triton.language``'s builtins by the
interpreter's, runs every program, then restores them. Triton 3.7 also re-does that patching at
each call of a ``@triton.jit`` helper inside the kernel (a dequantising helper in a loop: tens
of thousands of calls per test file), although the launch around it has already patched the very
same module objects. That repeated patching was about a third of the time the engine's 4-bit
tests spent in the interpreter. :func:`install` skips it inside a launch; the launch's own
patching and restoring are untouched, so kernels compute exactly what they computed before.

Only the test suite installs it, and only where the interpreter has the two names it wraps.
"""

from __future__ import annotations

import functools
import os


def install() -> bool:
    """Install the shortcut if ``TRITON_INTERPRET=1`` and this Triton has the names it needs;
    return whether it did."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter as it
    except ImportError:
        return False
    launch, patch = getattr(it, "GridExecutor", None), getattr(it, "_patch_lang", None)
    if launch is None or patch is None or getattr(patch, "_once_per_launch", False):
        return False
    state = {"launches": 0, "patched": set()}  # globals of the functions patched for

    @functools.wraps(patch)
    def patch_once(fn):
        # a launch patches the modules its kernel's globals name; a helper inside that launch
        # whose module names the same ones (the kernel's own module, any of ours) finds them
        # patched already; one whose module names others (triton.language's own jit helpers
        # see triton.language.core) patches those, as before, once per launch
        key = id(fn.__globals__)
        if state["launches"] and key in state["patched"]:
            return None
        scope = patch(fn)
        if state["launches"]:
            state["patched"].add(key)
        return scope

    patch_once._once_per_launch = True
    run = launch.__call__

    @functools.wraps(run)
    def run_patched_once(self, *args, **kwargs):
        outer = state["launches"], state["patched"]
        state["launches"], state["patched"] = state["launches"] + 1, set()
        try:
            return run(self, *args, **kwargs)
        finally:
            state["launches"], state["patched"] = outer

    it._patch_lang = patch_once
    launch.__call__ = run_patched_once
    return True
