"""Real text for measurements: the offline demo corpus, fixed-length token windows, perplexity.

The paper measures on C4 / Wikitext / the Pile (§3, §5.1). Offline we use the Lee background
corpus: 300 Australian news articles from 2001 (~76k SmolLM2 tokens), shipped as test data
inside the gensim wheel (:mod:`dejavu_lab.assets`). ``"wikitext-2"`` and ``"c4"`` load through
``datasets`` when a network is present.

Some tokenizers expect every text to start with BOS (Gemma: without it, perplexity is ~2x
higher); :func:`token_windows` then starts each window with it, and :func:`perplexity` records
whether it did, so perplexities stay comparable across families. The demo model's tokenizer
(SmolLM2) does not ask for BOS.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from . import assets
from .checks import scalars as check_scalars
from .checks import tokens as check_tokens
from .errors import CorpusError
from .vocab import CORPORA

__all__ = [
    "CorpusError",
    "CORPORA",
    "Perplexity",
    "load_text",
    "perplexity",
    "token_windows",
    "wants_bos",
    "window_nll",
]


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


def wants_bos(tokenizer) -> bool:
    """Whether ``tokenizer`` expects texts to start with its BOS token (``add_bos_token``).

    >>> from dejavu_lab.models import load_model
    >>> wants_bos(load_model("demo").tokenizer)  # SmolLM2: no
    False
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    if getattr(tokenizer, "add_bos_token", False):
        return True
    try:  # tokenizers whose post-processor adds it without the flag
        return tokenizer("a", add_special_tokens=True).input_ids[:1] == [bos]
    except Exception:
        return False


def token_windows(
    tokenizer,
    text: str,
    window: int = 512,
    max_windows: int | None = None,
    add_bos: bool | None = None,
) -> torch.Tensor:
    """Tokenise ``text`` once and cut it into non-overlapping windows: LongTensor [n, window].

    ``add_bos`` (default: :func:`wants_bos`) starts every window with the BOS token followed by
    ``window - 1`` text tokens; the tensor's ``add_bos`` attribute records the choice (a slice
    of it loses the attribute; :func:`perplexity` then reads the first column). The tail shorter
    than a window is dropped. Raises :class:`CorpusError` when the text holds less than one
    window.

    >>> from dejavu_lab.models import load_model
    >>> _, tokenizer, _ = load_model("demo")
    >>> w = token_windows(tokenizer, load_text("demo"), window=512)  # ~76k tokens
    >>> w.shape, w.add_bos
    (torch.Size([147, 512]), False)
    >>> token_windows(tokenizer, load_text("demo"), 512, add_bos=True)[:, 0].unique().tolist()
    [1]
    """
    text = check_tokens.text(text, tokenizer)
    window = check_scalars.integer(
        window, "window", minimum=2, error=CorpusError, hint="tokens per window"
    )
    if max_windows is not None:
        max_windows = check_scalars.integer(
            max_windows, "max_windows", minimum=1, error=CorpusError, hint="None takes every window"
        )
    bos = wants_bos(tokenizer) if add_bos is None else bool(add_bos)
    if bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise CorpusError("add_bos=True, but the tokenizer has no BOS token; pass add_bos=False.")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    step = window - 1 if bos else window  # text tokens per window
    n = ids.numel() // step
    if n == 0:
        raise CorpusError(
            f"The text has {ids.numel()} tokens, fewer than one window of "
            f"{window}; pass a longer text or a smaller window."
        )
    if max_windows is not None:
        n = min(n, max_windows)
    out = ids[: n * step].view(n, step)
    if bos:
        out = torch.cat([torch.full((n, 1), tokenizer.bos_token_id, dtype=out.dtype), out], 1)
    out.add_bos = bos
    return out


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


class Perplexity(float):
    """A perplexity (a float) that remembers whether its windows started with BOS.

    >>> p = Perplexity(29.44, add_bos=False)
    >>> p, p.add_bos, f"{p:.1f}"
    (29.44, False, '29.4')
    """

    add_bos: bool  # every window began with the BOS token (not itself predicted)

    def __new__(cls, value: float, add_bos: bool = False):
        self = super().__new__(cls, value)
        self.add_bos = bool(add_bos)
        return self


def perplexity(
    model, windows: torch.Tensor, batch_size: int = 1, progress: bool = True
) -> Perplexity:
    """exp(mean next-token NLL) over all windows (each window predicts its tokens 2..n).

    Returns a :class:`Perplexity` (a float) whose ``add_bos`` says whether the windows started
    with BOS: the windows' own ``add_bos`` attribute (from :func:`token_windows`), else whether
    every window's first token is the model's ``bos_token_id``. A random model is about as
    perplexed as a uniform guess over its 128-token vocabulary:

    >>> from dejavu_lab.models import random_model
    >>> model = random_model("tiny-llama").model
    >>> windows = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    >>> ppl = perplexity(model, windows, progress=False)
    >>> round(ppl), ppl.add_bos
    (132, False)
    """
    value = math.exp(window_nll(model, windows, batch_size, progress).mean().item())
    bos = getattr(windows, "add_bos", None)
    if bos is None:
        bos_id = getattr(getattr(model, "config", None), "bos_token_id", None)
        bos = bos_id is not None and bool((windows[:, 0] == bos_id).all())
    return Perplexity(value, add_bos=bos)
