"""Sizes, counts and fractions: whole numbers in a range, fractions inside an interval.

``8.5`` tokens, ``True`` epochs, a batch size of ``0`` or ``"16"`` layers are not silently
truncated, compared as strings or turned into an empty loop: they are refused here in one
sentence that ends with a value to pass instead (the nearest whole number in range, for a
count). Whole floats (``16.0``), numpy integers and 0-d tensors are accepted and returned as
``int``.
"""

from __future__ import annotations

import math
import numbers

from ..errors import InputError

__all__ = ["fraction", "integer", "positive"]


def _suggest(value, minimum: int | None, maximum: int | None) -> int:
    """The whole number nearest to what was meant (``"16"`` → 16, 16.5 → 16), inside the range."""
    try:
        eg = int(float(value))
    except (TypeError, ValueError, OverflowError):
        eg = minimum if minimum is not None else 0
    if minimum is not None:
        eg = max(eg, minimum)
    if maximum is not None:
        eg = min(eg, maximum)
    return eg


def _tail(name: str, eg, hint: str) -> str:
    return f"; pass e.g. {name}={eg}" + (f" ({hint})." if hint else ".")


def integer(
    value,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[Exception] = InputError,
    hint: str = "",
) -> int:
    """``value`` as an ``int`` in [minimum, maximum], or ``error`` with one sentence.

    >>> integer(16.0, "window", minimum=2)
    16
    >>> integer(0, "epochs", minimum=1, hint="train for at least one epoch")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: epochs must be at least 1 (a whole number), got 0; pass e.g. ...
    """
    if maximum is None:
        want = f"at least {minimum} (a whole number)" if minimum is not None else "a whole number"
    elif minimum is None:
        want = f"at most {maximum} (a whole number)"
    else:
        want = f"a whole number in [{minimum}, {maximum}]"
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # a 0-d tensor or numpy scalar
    whole = (
        isinstance(value, numbers.Integral)
        or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    ) and not isinstance(value, bool)
    ok = whole and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        eg = _suggest(value, minimum, maximum)
        raise error(f"{name} must be {want}, got {value!r}" + _tail(name, eg, hint))
    return int(value)


def positive(
    value,
    name: str,
    *,
    example: float = 1.0,
    error: type[Exception] = InputError,
    hint: str = "",
) -> float:
    """A finite number > 0 (a learning rate, a weight cap), as ``float``.

    >>> positive(3e-3, "lr")
    0.003
    >>> positive(float("nan"), "lr", example=3e-3)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: lr must be a finite number > 0, got nan; pass e.g. lr=0.003.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        ok = False
    else:
        ok = math.isfinite(value) and value > 0
    if not ok:
        raise error(
            f"{name} must be a finite number > 0, got {value!r}" + _tail(name, example, hint)
        )
    return float(value)


def fraction(
    value,
    name: str,
    *,
    closed: str = "",
    example: float = 0.5,
    error: type[Exception] = InputError,
    hint: str = "",
) -> float:
    """A number inside (0, 1); ``closed="left"`` admits 0, ``"right"`` admits 1, ``"both"`` both.

    >>> fraction(0.1, "val_fraction")
    0.1
    >>> fraction(1.0, "val_fraction", example=0.1)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: val_fraction must be in (0, 1), got 1.0; pass e.g. val_fraction=0.1.
    """
    lo = "[" if closed in ("left", "both") else "("
    hi = "]" if closed in ("right", "both") else ")"
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value >= 0 if lo == "[" else value > 0) and (value <= 1 if hi == "]" else value < 1)
    if not ok:
        raise error(f"{name} must be in {lo}0, 1{hi}, got {value!r}" + _tail(name, example, hint))
    return float(value)
