"""Real text for measurements: the offline demo corpus, fixed-length token windows, perplexity.

The paper measures on C4 / Wikitext / the Pile (§3, §5.1). Offline we use the Lee background
corpus: 300 Australian news articles from 2001 (~76k SmolLM2 tokens), shipped as test data
inside the gensim wheel (:mod:`dejavu_lab.assets`). ``"wikitext-2"`` and ``"c4"`` load through
``datasets`` when a network is present.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from . import assets
from .checks import scalars as check_scalars
from .checks import tokens as check_tokens

__all__ = ["CorpusError", "CORPORA", "load_text", "perplexity", "token_windows", "window_nll"]

CORPORA = ("demo", "wikitext-2", "c4")


class CorpusError(ValueError):
    """A corpus could not be loaded or is too short for what was asked.

    >>> load_text("wiki")
    Traceback (most recent call last):
    ...
    dejavu_lab.corpus.CorpusError: Unknown corpus 'wiki'; choose one of demo, wikitext-2, c4.
    """


def load_text(name: str = "demo", split: str = "test", max_chars: int | None = None) -> str:
    """Plain text of a corpus; documents separated by blank lines.

    >>> text = load_text("demo")
    >>> text[:40], len(text.split("\\n\\n"))  # the Lee corpus: 300 news articles
    ('Hundreds of people have been forced to v', 300)
    """
    if name == "demo":
        raw = assets.fetch("lee_background.cor").read_text(encoding="utf-8")
        text = "\n\n".join(line.strip() for line in raw.splitlines() if line.strip())
    elif name in ("wikitext-2", "c4"):
        text = _hf_dataset_text(name, split, max_chars)
    else:
        raise CorpusError(f"Unknown corpus {name!r}; choose one of {', '.join(CORPORA)}.")
    return text[:max_chars] if max_chars else text


def _hf_dataset_text(name: str, split: str, max_chars: int | None) -> str:
    try:
        import datasets
    except ImportError:
        raise CorpusError(
            f"Corpus {name!r} needs the `datasets` package: "
            "pip install 'dejavu-lab[data]', or use 'demo' offline."
        ) from None
    try:
        if name == "wikitext-2":
            ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
            return "".join(ds["text"])
        ds = datasets.load_dataset("allenai/c4", "en", split="validation", streaming=True)
        parts, n = [], 0
        for row in ds:
            parts.append(row["text"])
            n += len(row["text"])
            if n >= (max_chars or 2_000_000):
                break
        return "\n\n".join(parts)
    except Exception as e:  # datasets raises many types for "offline"
        raise CorpusError(
            f"Could not load {name!r} through datasets ({type(e).__name__}); "
            "it needs a network or a filled HF_DATASETS cache; use 'demo' "
            "offline."
        ) from None


def token_windows(
    tokenizer, text: str, window: int = 512, max_windows: int | None = None
) -> torch.Tensor:
    """Tokenise ``text`` once and cut it into non-overlapping windows: LongTensor [n, window].

    The tail shorter than a window is dropped. Raises :class:`CorpusError` when the text holds
    less than one window.

    >>> from dejavu_lab.models import load_model
    >>> _, tokenizer, _ = load_model("demo")
    >>> token_windows(tokenizer, load_text("demo"), window=512).shape  # ~76k tokens
    torch.Size([147, 512])
    """
    text = check_tokens.text(text, tokenizer)
    window = check_scalars.integer(
        window, "window", minimum=2, error=CorpusError, hint="tokens per window"
    )
    if max_windows is not None:
        max_windows = check_scalars.integer(
            max_windows, "max_windows", minimum=1, error=CorpusError, hint="None takes every window"
        )
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    n = ids.numel() // window
    if n == 0:
        raise CorpusError(
            f"The text has {ids.numel()} tokens, fewer than one window of "
            f"{window}; pass a longer text or a smaller window."
        )
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[: n * window].view(n, window)


@torch.no_grad()
def window_nll(
    model,
    windows: torch.Tensor,
    batch_size: int = 1,
    progress: bool = True,
    desc: str = "perplexity",
) -> torch.Tensor:
    """Mean next-token negative log-likelihood of each window: FloatTensor [n].

    A random model guesses about uniformly, so its NLL is near ln(vocab) = ln 128 = 4.85:

    >>> from dejavu_lab.models import random_model
    >>> model = random_model("tiny-llama").model
    >>> windows = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    >>> window_nll(model, windows, progress=False)
    tensor([4.87, 4.88, 4.89, 4.91])
    """
    windows = check_tokens.windows(windows, model)  # ints [n >= 1, 2 <= window <= positions]
    batch_size = check_scalars.integer(batch_size, "batch_size", minimum=1, error=CorpusError)
    device = next(model.parameters()).device
    out = []
    batches = range(0, windows.shape[0], batch_size)
    for s in tqdm(batches, desc=desc, disable=not progress, leave=False):
        ids = windows[s : s + batch_size].to(device)
        logits = model(input_ids=ids).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
        )
        out.append(nll.view(ids.shape[0], -1).mean(1).cpu())
    return torch.cat(out)


def perplexity(model, windows: torch.Tensor, batch_size: int = 1, progress: bool = True) -> float:
    """exp(mean next-token NLL) over all windows (each window predicts its tokens 2..n).

    A random model is about as perplexed as a uniform guess over its 128-token vocabulary:

    >>> from dejavu_lab.models import random_model
    >>> model = random_model("tiny-llama").model
    >>> windows = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    >>> round(perplexity(model, windows, progress=False))
    132
    """
    return math.exp(window_nll(model, windows, batch_size, progress).mean().item())
