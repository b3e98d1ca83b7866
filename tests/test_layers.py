"""The package's layers, read from its own imports: no import circle and no arrow pointing up.

Every module of ``dejavu_lab`` is parsed with :mod:`ast`; each ``import`` / ``from ... import``
that names another module of the package is an arrow, whether it sits at module level or inside
a function (an import inside a function still closes a circle; it only hides it from the
interpreter). ``from .pkg import name`` points at ``pkg.name`` when that is a module, else at
``pkg`` itself (its ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dejavu_lab"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package's modules it imports (module level and inside functions)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else source)
            for target in targets:
                while target and target not in modules:  # ``import a.b.c`` -> the module a.b.c
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _in(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


P = "dejavu_lab."
# (who, may not import, why)
RULES = [
    (
        (P + "kernels",),
        (P + m for m in ("models", "hooks", "results", "report", "engine", "cli")),
        "kernels know tensors only",
    ),
    (
        (P + "measure",),
        (P + m for m in ("kernels", "engine", "report", "cli")),
        "the paper's observations run on any CPU",
    ),
    (
        (P + m for m in ("engine", "kernels", "sparsify", "measure")),
        (P + "report", P + "cli"),
        "compute never draws or parses arguments",
    ),
    ((P + "report",), (P + "cli",), "the book's tables and figures never parse arguments"),
    (
        (P + m for m in ("engine", "kernels", "sparsify", "measure", "cli")),
        (P + "bench",),
        "the benchmarks' layer sits above everything that computes",
    ),
    ((P + "checks",), None, "checks read only errors and vocab"),
    ((P + "step_bytes",), None, "the byte model is arithmetic on the vocabulary's sites"),
    ((P + "engine",), (P + "sparsify",), "the engine counts its bytes without the quality path"),
    ((P + "errors", P + "vocab"), (P,), "the base layer imports nothing of ours"),
]


def test_no_import_cycle_counting_imports_inside_functions():
    found = cycles(import_graph())
    assert found == [], f"import circles: {found}"


@pytest.mark.parametrize("who, banned, why", RULES, ids=[r[2] for r in RULES])
def test_layer_rules(who, banned, why):
    who = tuple(who)
    allowed_for_checks = (P + "errors", P + "vocab", P + "checks")
    banned = tuple(banned) if banned is not None else None
    wrong = []
    for module, targets in import_graph().items():
        if not _in(module, *who):
            continue
        for target in targets:
            if banned is None:
                bad = not _in(target, *allowed_for_checks)
            else:
                bad = any(_in(target, b.rstrip(".")) for b in banned)
            if bad:
                wrong.append(f"{module} -> {target}")
    assert wrong == [], f"{why}: {wrong}"


DRAWING = ("pandas", "plotly", "seaborn", "matplotlib", "ipywidgets")


def _third_party_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports in a module, inside functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.partition(".")[0])
    return names


def test_compute_imports_no_tables_or_figures():
    """The engine and the kernels run on a bare GPU image: no pandas, plotly, seaborn,
    matplotlib or ipywidgets, at module level or inside a function (those live in report/)."""
    wrong = [
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for package in ("engine", "kernels")
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in sorted(_third_party_imports(path) & set(DRAWING))
    ]
    assert wrong == [], f"compute packages must not draw: {wrong}"


# The package's layers, bottom up (the order of dejavu_lab/__init__.py's docstring): a module
# imports from its own layer and the layers below it, never from one above.
LAYERS = [
    ("vocab", "errors", "checks"),
    ("atomic", "assets", "results", "staleness", "step_bytes"),
    ("arch", "gguf_cache", "models", "hooks", "corpus", "budgets", "quant"),
    ("collect", "predictors", "deferred_kv", "bytes_model", "sparsify", "lm_eval_tasks"),
    ("measure",),
    ("kernels", "engine"),
    ("bench", "report", "cli"),
]


def _layer(module: str) -> int | None:
    part = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(LAYERS) if part in names), None)


def test_every_module_has_a_layer_and_no_import_points_up():
    graph = import_graph()
    unplaced = sorted(m for m in graph if m != "dejavu_lab" and _layer(m) is None)
    assert unplaced == [], f"add these modules to a layer of LAYERS: {unplaced}"
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                if m != "dejavu_lab" and _layer(t) is not None and _layer(t) > _layer(m))  # fmt: skip
    assert up == [], f"imports that point up a layer: {up}"


def test_no_module_getattr_shims():
    shims = [
        str(p.relative_to(ROOT.parent))
        for p in ROOT.rglob("*.py")
        if any(
            isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
            for n in ast.parse(p.read_text()).body
        )
    ]
    assert shims == [], f"module-level __getattr__ re-exports: {shims}"


def test_the_counter_sees_imports_inside_functions(tmp_path):
    """The counter itself: a circle closed by an import inside a function is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import f\n")
    (pkg / "a.py").write_text("from .sub.b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    assert len(import_graph()) > 50, "the package was not parsed"
    (pkg / "sub" / "c.py").write_text(
        "def f():\n    import pandas.api\n    from plotly import io\n"
    )
    assert _third_party_imports(pkg / "sub" / "c.py") == {"pandas", "plotly"}


def test_no_package_name_hides_one_of_its_modules():
    """``from .cats_mlp import cats_mlp`` in a package's ``__init__`` made the module
    unreachable as ``pkg.cats_mlp`` (the function took its name): no package does that."""
    hidden = []
    for init in ROOT.rglob("__init__.py"):
        pkg = init.parent
        subs = {p.stem for p in pkg.glob("*.py")} | {p.name for p in pkg.iterdir() if p.is_dir()}
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                hidden += [f"{pkg.name}.{a.asname or a.name}" for a in node.names
                           if (a.asname or a.name) in subs]  # fmt: skip
    assert hidden == [], f"package names that hide a module of the same name: {hidden}"
