"""Where a speed chapter's numbers come from, said the same way in every caption and sentence.

The speed chapters measure live on a GPU box and otherwise draw a recording from ``results/``.
These helpers put that choice into words, so no caption says "recorded" over live numbers or
"no GPU here" on a GPU: :func:`caption` (measured live on ..., or recorded on ... with the
recording's age from :mod:`dejavu_lab.staleness`), :func:`origin` for a clause inside a
sentence, and :func:`listing` for sentences over whatever models ran.
"""

from __future__ import annotations

import torch

from .. import results, staleness

__all__ = ["caption", "listing", "origin"]


def listing(items) -> str:
    """Items as prose: 'a', 'a and b', 'a, b and c'.

    >>> listing(["opt-30b"]), listing(["opt-30b", "opt-6.7b", "llama-2-13b"])
    ('opt-30b', 'opt-30b, opt-6.7b and llama-2-13b')
    """
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def origin(prov: dict, *, live: bool, frame=None) -> str:
    """A clause naming where numbers come from: 'measured live on <GPU> (<date>)', or
    'recorded on <GPU>, <date> (torch, triton), measured at <commit>, <age>' for a recording.

    >>> origin({"gpu": "NVIDIA H200", "date": "2026-12-05T01:00:00+00:00"}, live=True)
    'measured live on NVIDIA H200 (2026-12-05)'
    >>> origin(results.load("engine_e2e")[1], live=False)
    'recorded on NVIDIA H200, 2026-12-01 (torch ..., triton ...), measured at 360074a, ...'
    """
    if live:
        return f"measured live on {prov.get('gpu', 'this GPU')} ({str(prov.get('date', ''))[:10]})"
    return f"recorded on {results.describe(prov)}, {staleness.note(prov, frame)}"


def caption(prov: dict, *, live: bool, files=(), frame=None, gpu: bool | None = None) -> str:
    """A figure caption's first lines: where its numbers come from and, for a recording, which
    files and why no live run (no GPU here, or ``LIVE = False`` on a GPU box).

    >>> caption({"gpu": "NVIDIA H200", "date": "2026-12-05T01:00:00"}, live=True)
    'Measured live on NVIDIA H200 (2026-12-05).'
    >>> prov = results.load("engine_e2e")[1]
    >>> caption(prov, live=False, files=["results/engine_e2e.json"], gpu=False)
    'Recorded on NVIDIA H200, ..., measured at 360074a, ...<br>No GPU here: drawn from results/engine_e2e.json.'
    >>> caption(prov, live=False, files=["results/engine_e2e.json"], gpu=True).split("<br>")[1]
    'LIVE = False: drawn from results/engine_e2e.json.'
    """
    text = origin(prov, live=live, frame=frame)
    text = text[0].upper() + text[1:] + "."
    if live:
        return text
    gpu = torch.cuda.is_available() if gpu is None else gpu
    why = "LIVE = False" if gpu else "No GPU here"
    return text + (f"<br>{why}: drawn from {listing(files)}." if files else "")
