"""The layers of docs/ARCHITECTURE.md, checked on the source: every import of every module
(parsed, nothing imported) goes to its own layer or one below, and no modules import
each other in a circle, even through imports made inside functions. No module of the
library reaches into another's private names (``_name``), and the benchmarks use the
library only through names it does not keep private."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
BENCH = Path(__file__).resolve().parent.parent / "bench"

# outer to inner; a module may import its own layer and the layers below
LAYERS: list[tuple[str, ...]] = [
    ("unickpt", "unickpt.__main__", "unickpt.cli", "unickpt.demo", "unickpt.demo_fault", "unickpt.demo_live", "unickpt.demo_resume",
     "unickpt.examples", "unickpt.testing"),
    ("unickpt.api", "unickpt.dcp", "unickpt.integrations"),
    ("unickpt.live",),
    ("unickpt.snapshot",),
    ("unickpt.adapters", "unickpt.rules"),
    ("unickpt.engine",),
    ("unickpt.format", "unickpt.plan", "unickpt.storage"),
    ("unickpt.errors", "unickpt.dist", "unickpt.version", "unickpt.units", "unickpt.logs", "unickpt.store_client",
     "unickpt.kept_connections"),
]


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest package prefix of ``module``."""
    best, depth = None, -1
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and n.count(".") > depth:
                best, depth = i, n.count(".")
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/ARCHITECTURE.md"
    return best


def imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from X import ...`` in ``package`` names (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    return ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))


@functools.cache
def module_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Each module of the package and the unickpt modules it imports (a ``from X import
    name`` counts as an import of ``X.name`` when that is a module, else of ``X``)."""
    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (root / "unickpt").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = imported_from(node, package)
                for a in node.names:
                    targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base)
        graph[mod] = {t for t in targets if t in files and t != mod}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import of a module into a higher layer."""
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if layer_of(b) < layer_of(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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


def test_no_import_runs_up_a_layer():
    assert upward_imports(module_graph()) == []


def test_no_modules_import_each_other_in_a_circle():
    assert cycles(module_graph()) == []


def test_the_checks_catch_what_they_look_for(tmp_path):
    pkg = tmp_path / "unickpt"
    for name, text in {
        "__init__.py": "", "errors.py": "", "engine/__init__.py": "", "api/__init__.py": "",
        "engine/a.py": "from ..api import b\n", "api/b.py": "def f():\n    from ..engine import a\n",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    graph = module_graph(tmp_path)
    assert upward_imports(graph) == ["unickpt.engine.a -> unickpt.api.b"]
    assert cycles(graph) == [["unickpt.api.b", "unickpt.engine.a"]]


def test_the_snapshot_tier_sits_below_the_entry_points():
    # the arrow the snapshot tier once had (snapshot.client -> api.async_save) is upward now
    graph = {"unickpt.snapshot.client": {"unickpt.api.async_save"}, "unickpt.api.manager": {"unickpt.snapshot.client"}}
    assert upward_imports(graph) == ["unickpt.snapshot.client -> unickpt.api.async_save"]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path, module: str, package: str, modules: set[str]) -> list[str]:
    """``file:line: module._name`` for every private name of another unickpt module that
    the file at ``path`` (the module ``module`` of ``package``; "" outside the library)
    takes: ``from unickpt.x import _name``, or ``x._name`` on a unickpt module it imported."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[str] = []
    bound: dict[str, str] = {}  # local name -> the unickpt module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = imported_from(node, package)
            if base.split(".")[0] != "unickpt":
                continue
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
                elif _private(a.name) and base != module:
                    out.append(f"{path.name}:{node.lineno}: {base}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "unickpt" and a.asname and a.name in modules:
                    bound[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            target = bound.get(node.value.id) if isinstance(node.value, ast.Name) else None
            if target is None and isinstance(node.value, ast.Attribute):  # unickpt.x.y._name
                target = ast.unparse(node.value) if ast.unparse(node.value) in modules else None
            if target is not None and target != module:
                out.append(f"{path.name}:{node.lineno}: {target}.{node.attr}")
    return out


def _modules(root: Path = SRC) -> dict[str, Path]:
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in (root / "unickpt").rglob("*.py")}


def test_no_module_takes_another_module_s_private_names():
    files = _modules()
    found = []
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found += private_uses(path, mod, package, set(files))
    assert found == []


# the benchmarks' remaining uses of private names, each with the work that removes it
# (an entry no benchmark has any more fails the test: the list only shrinks)
BENCH_PRIVATE_KNOWN: dict[str, str] = {}  # "file: module.name" -> why it is still used (none now)


def test_the_bench_takes_no_private_name_of_the_library():
    modules = set(_modules())
    found = {use.split(":", 1)[0] + ":" + use.split(":", 2)[2] for p in sorted(BENCH.glob("*.py"))
             for use in private_uses(p, "", "", modules)}
    assert sorted(found - set(BENCH_PRIVATE_KNOWN)) == []
    assert sorted(set(BENCH_PRIVATE_KNOWN) - found) == [], "no longer used: remove from BENCH_PRIVATE_KNOWN"


def test_the_private_name_check_catches_what_it_looks_for(tmp_path):
    modules = {"unickpt", "unickpt.engine", "unickpt.engine.a", "unickpt.api", "unickpt.api.b"}
    (tmp_path / "b.py").write_text(
        "from ..engine.a import _hidden, shown\n"
        "from ..engine import a\n"
        "import unickpt.engine.a as ea\n"
        "from . import b\n"
        "x = a._other + ea._third + a.shown + b._own\n"
        "def f():\n    from unickpt.engine.a import _late\n"
    )
    got = private_uses(tmp_path / "b.py", "unickpt.api.b", "unickpt.api", modules)
    assert sorted(got) == ["b.py:1: unickpt.engine.a._hidden", "b.py:5: unickpt.engine.a._other",
                           "b.py:5: unickpt.engine.a._third", "b.py:7: unickpt.engine.a._late"]
