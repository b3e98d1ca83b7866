"""dejavu_lab.corpus: the real demo corpus, windows, perplexity, and bad input."""

import math

import pytest
import torch

from dejavu_lab.corpus import CorpusError, load_text, perplexity, token_windows, window_nll
from dejavu_lab.models import random_model


def test_demo_corpus_is_the_lee_news_corpus():
    text = load_text("demo")
    docs = text.split("\n\n")
    assert len(docs) == 300
    assert docs[0].startswith("Hundreds of people have been forced to vacate their homes")
    assert 300_000 < len(text) < 400_000


class CharTokenizer:
    """One token per byte: a real (if simple) tokenizer for window arithmetic."""

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        class Out:
            input_ids = torch.tensor([list(text.encode()[:100_000])])

        return Out()


def test_windows_are_contiguous_and_drop_the_tail():
    w = token_windows(CharTokenizer(), "abcdefghij", window=3)
    assert w.tolist() == [[97, 98, 99], [100, 101, 102], [103, 104, 105]]
    assert token_windows(CharTokenizer(), "abcdefghij", window=3, max_windows=1).shape == (1, 3)


@pytest.mark.parametrize(
    "text,window,match",
    [
        ("short", 512, "5 tokens, fewer than one window of 512"),
        ("", 4, "the text is empty"),
        ("abc", 1, "window must be at least 2"),
    ],
)
def test_bad_windows(text, window, match):
    with pytest.raises(CorpusError, match=match):
        token_windows(CharTokenizer(), text, window=window)


def test_unknown_corpus():
    with pytest.raises(CorpusError, match="Unknown corpus 'pile'.*demo"):
        load_text("pile")


def test_perplexity_of_uniform_logits_is_the_vocabulary_size():
    model, _, _ = random_model("tiny-llama")
    torch.nn.init.zeros_(model.lm_head.weight)  # every logit 0: uniform next-token distribution
    windows = torch.randint(0, 128, (3, 16))
    assert perplexity(model, windows, progress=False) == pytest.approx(128, rel=1e-5)
    assert window_nll(model, windows, batch_size=2, progress=False).shape == (3,)


def test_perplexity_rejects_empty_windows():
    model, _, _ = random_model("tiny-llama")
    with pytest.raises(CorpusError, match="non-empty"):
        perplexity(model, torch.zeros(0, 16, dtype=torch.long))


@pytest.mark.slow
def test_demo_model_perplexity_on_demo_corpus(demo):
    model, tokenizer, _ = demo
    windows = token_windows(tokenizer, load_text("demo"), window=512, max_windows=2)
    ppl = perplexity(model, windows, progress=False)
    assert 10 < ppl < 60, ppl  # ≈30 over the whole corpus (README)
    assert not math.isnan(ppl)


def test_online_corpus_without_datasets_says_what_to_install():
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(CorpusError, match="needs the `datasets` package.*'demo' offline"):
            load_text("wikitext-2")
    else:
        pytest.skip("datasets is installed here; the offline path is covered where it is not")
