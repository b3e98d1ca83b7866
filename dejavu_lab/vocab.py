"""The project's words, in one module that imports nothing of ours: hook points, input-sparsity
sites, the sparsity methods, corpora and file formats.

Every part of the package reads its lists from here: the CLI's ``--method`` choices, the
explorer's methods, the lm-eval bridge, ``sparsified``'s registry and the engine's
``SparseConfig``. A new method is one module (its hook builder, :mod:`dejavu_lab.sparsify`) and
one row of :data:`METHODS`.

>>> [m.name for m in METHODS.values() if m.engine]  # what the decoder runs
['dense', 'dejavu', 'teal', 'wina', 'cats', 'larosa', 'rsparse']
>>> METHODS["wina"].sites, METHODS["wina"].needs, METHODS["wina"].allocation
(('attn_in', 'o_in', 'mlp_in', 'down_in'), 'calibration', 'greedy')
>>> method("predicted").name  # DejaVu's sets, by their older name
'dejavu'
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CALIBRATION_FORMAT",
    "COLLECTION_FORMAT",
    "CORPORA",
    "FINGERPRINT_KEYS",
    "FINGERPRINT_VERSION",
    "HOOK_POINTS",
    "METHODS",
    "SITES",
    "WRITABLE",
    "Method",
    "fingerprint_id",
    "method",
    "method_names",
    "site_width",
]

# TransformerLens-style hook points of a block (``blocks.{i}.<point>``), in forward order.
HOOK_POINTS = (
    "hook_resid_pre",
    "attn.hook_z",
    "attn.hook_result",
    "attn.hook_pattern",
    "hook_attn_out",
    "hook_resid_mid",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_post",
    # inputs of the linear layers (input-sparsity sites), in forward order within the block
    "ln1.hook_normalized",
    "ln2.hook_normalized",
    "mlp.hook_pre",
)
# the points whose value a hook may replace (the rest are read-only views)
WRITABLE = frozenset(
    {
        "hook_resid_pre",
        "attn.hook_z",
        "hook_attn_out",
        "mlp.hook_post",
        "hook_mlp_out",
        "hook_resid_post",
        "ln1.hook_normalized",
        "ln2.hook_normalized",
        "mlp.hook_pre",
    }
)

# Input-sparsity sites of a layer -> the hook point that carries the site's vector. A site is
# the input of a linear layer: its entries select that weight's columns.
SITES = {
    "attn_in": "ln1.hook_normalized",  # shared input of q/k/v  [b, p, d]
    "o_in": "attn.hook_z",  # input of o_proj / out_proj, per head  [b, p, h, dh]
    "mlp_in": "ln2.hook_normalized",  # shared input of gate/up or fc1  [b, p, d]
    "down_in": "mlp.hook_post",  # input of down_proj / fc2  [b, p, n]
}


def site_width(arch, site: str) -> int:
    """Entries of one token's vector at ``site`` (CATS's ``"gate"``: one per MLP neuron).

    ``arch`` is anything with ``d_model``, ``n_heads``, ``d_head`` and ``d_mlp``
    (:class:`dejavu_lab.arch.Arch`, the engine's weights).

    >>> from types import SimpleNamespace
    >>> a = SimpleNamespace(d_model=64, n_heads=4, d_head=16, d_mlp=192)
    >>> [site_width(a, s) for s in ("attn_in", "o_in", "mlp_in", "down_in", "gate")]
    [64, 64, 64, 192, 192]
    """
    if site in ("attn_in", "mlp_in"):
        return arch.d_model
    if site == "o_in":
        return arch.n_heads * arch.d_head
    if site in ("down_in", "gate"):
        return arch.d_mlp
    raise KeyError(f"unknown site {site!r}; sites are {', '.join((*SITES, 'gate'))}")


@dataclass(frozen=True)
class Method:
    """One contextual-sparsity method: what it keeps, what it needs, who runs it.

    A new method is its row here and its builder in :mod:`dejavu_lab.sparsify` (registered
    under the same name); the CLI prepares what ``needs`` names and the budgets ``family``
    takes.

    >>> cats = METHODS["cats"]
    >>> cats.family, cats.sites, cats.needs, cats.engine
    ('threshold', ('gate',), 'calibration', True)
    """

    name: str
    family: str  # "dense"; "unit": top-k neurons and heads; "threshold": |x| > t per site;
    # "topk": a fixed top-k per token of a transformed site input (rotated, or beside a low-rank
    # term), run from a plan (dejavu_lab.sparsify.topk) built on calibration moments
    sites: tuple[str, ...]  # threshold family: the sites it thresholds; unit: ("mlp", "heads")
    needs: str  # what must exist first: "nothing", "calibration", "predictors", "static sets"
    engine: bool  # the decoder (dejavu_lab.engine) runs it, not only the hooks on HF models
    allocation: str = "uniform"  # default share of the budget over layers/sites ("greedy": TEAL)
    # threshold family: what is compared with the threshold at a site: "magnitude" |x_i|,
    # "weighted" |x_i| * ||W[:, i]||_2 (one threshold per column, t / ||W[:, i]||), "gate"
    # |act(gate_j)| per MLP neuron
    score: str = ""
    aliases: tuple[str, ...] = ()  # older names that still select it
    paper: str = ""  # where it comes from

    @property
    def input_sparse(self) -> bool:
        """Thresholds the inputs of linear layers: entry i selects weight column i (TEAL, WINA).

        >>> METHODS["wina"].input_sparse, METHODS["cats"].input_sparse
        (True, False)
        """
        return self.family == "threshold" and self.score != "gate"

    @property
    def options(self) -> tuple[str, ...]:
        """The arguments of ``sparsified`` (and the CLI flags behind them) this method reads,
        from its row: the budgets of its ``family``, what it ``needs``, and ``allocation`` where
        it has a choice (its default is ``"greedy"``). Any other one given is an error; every
        method also takes ``dense_layers``.

        >>> METHODS["cats"].options, METHODS["dense"].options
        (('sparsity', 'thresholds'), ())
        >>> METHODS["dejavu"].options
        ('sparsity', 'mlp_sparsity', 'head_sparsity', 'predictors')
        """
        if self.family == "dense":
            return ()
        unit = self.family == "unit"
        budgets = ("sparsity", "mlp_sparsity", "head_sparsity") if unit else ("sparsity",)
        need = {"static sets": "static", "predictors": "predictors", "calibration": "thresholds"}
        extra = (need[self.needs],) if self.needs in need else ()
        refit = ("refit",) if self.input_sparse else ()
        return budgets + extra + (("allocation",) if self.allocation == "greedy" else ()) + refit


_TEAL_SITES = ("attn_in", "o_in", "mlp_in", "down_in")
_UNITS = ("mlp", "heads")
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("dense", "dense", (), "nothing", engine=True),
        Method("oracle", "unit", _UNITS, "nothing", engine=False,
               paper="each token's own top-k (Deja Vu §3.1)"),
        Method("static", "unit", _UNITS, "static sets", engine=False,
               paper="one set per layer for every token (Deja Vu §3.1)"),
        Method("dejavu", "unit", _UNITS, "predictors", engine=True, aliases=("predicted",),
               paper="Deja Vu's lookahead predictors (§4)"),
        Method("teal", "threshold", _TEAL_SITES, "calibration", engine=True,
               allocation="greedy", score="magnitude", paper="TEAL (Liu et al., 2024)"),
        Method("wina", "threshold", _TEAL_SITES, "calibration", engine=True,
               allocation="greedy", score="weighted", paper="WINA (Chen et al., 2025)"),
        Method("cats", "threshold", ("gate",), "calibration", engine=True,
               score="gate", paper="CATS (Lee et al., 2024)"),
        Method("larosa", "topk", _TEAL_SITES, "calibration", engine=True,
               score="rotated", paper="LaRoSA (Liu et al., ICML 2025)"),
        Method("rsparse", "topk", _TEAL_SITES, "calibration", engine=True,
               score="sparse + low rank", paper="R-Sparse (Zhang et al., ICLR 2025)"),
    )
}  # fmt: skip
ALIASES = {a: m.name for m in METHODS.values() for a in m.aliases}


def method(name: str) -> Method:
    """The :class:`Method` called ``name`` (or one of its older names); ``KeyError`` else.

    >>> method("teal").allocation, method("predicted").name
    ('greedy', 'dejavu')
    >>> method("relu")
    Traceback (most recent call last):
    ...
    KeyError: "unknown method 'relu'; methods are dense, oracle, static, dejavu, teal, wina, cats, ..."
    """
    name = ALIASES.get(name, name)
    if name not in METHODS:
        raise KeyError(f"unknown method {name!r}; methods are {', '.join(METHODS)}")
    return METHODS[name]


def method_names(*, family: str | None = None, engine: bool | None = None) -> tuple[str, ...]:
    """Method names in the table's order, optionally of one family or the ones the engine runs.

    >>> method_names(family="unit"), method_names(family="threshold")
    (('oracle', 'static', 'dejavu'), ('teal', 'wina', 'cats'))
    """
    return tuple(
        m.name
        for m in METHODS.values()
        if (family is None or m.family == family) and (engine is None or m.engine == engine)
    )


CORPORA = ("demo", "wikitext-2", "c4")  # load_text's names: demo is offline, the rest online

COLLECTION_FORMAT = 1  # collection folders (bump when the chunk layout changes)
CALIBRATION_FORMAT = "dejavu-lab-calibration/1"  # calibration files
# the fields of a model fingerprint that must match for a cached file to belong to a model
FINGERPRINT_KEYS = (
    "model_type", "n_layers", "d_model", "n_heads", "d_mlp", "weights_sha256", "version"
)  # fmt: skip
# 2: sha256 over every parameter's and buffer's bytes (1, unmarked: 8 rows of 3 matrices)
FINGERPRINT_VERSION = 2


def fingerprint_id(fp: dict) -> str:
    """A short readable name for a model fingerprint, used in cache folder and file names.

    Twelve hex digits of the weights' hash (the older fingerprint, which hashed a few rows of
    three matrices, named its entries with eight: such names are never looked up again).

    >>> fingerprint_id({"model_type": "llama", "n_layers": 2, "d_model": 64,
    ...                 "weights_sha256": "0123456789abcdef"})
    'llama-L2-d64-0123456789ab'
    """
    return f"{fp['model_type']}-L{fp['n_layers']}-d{fp['d_model']}-{fp['weights_sha256'][:12]}"
