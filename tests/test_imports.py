"""The import graph: no cycles, and the core never imports a plug-in package.

Every module of the installed ``trace_gym`` (sources under ``trace_gym/``, ``envs/``,
``allocators/``, ``trainers/``, mapped to their installed names) is parsed with ``ast``;
module-level and function-level imports count, imports under ``if TYPE_CHECKING:`` and
``if __name__ == "__main__":`` do not (they never run on import). ``import a.b`` is an edge to ``a.b``; ``from pkg import name`` an edge to
``pkg.name`` when that is a module, else to ``pkg``. A package's ``__init__`` importing its
own submodules is an edge like any other. The core (``trace_gym.*`` outside the plug-in
packages ``trace_gym.envs``, ``trace_gym.allocators``, ``trace_gym.trainers``) reaches
plug-ins only through registries and entry points.

Also: the public API of ``import trace_gym``, its docstrings, and that it stays light.
"""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {  # installed package name -> source folder (setuptools package-dir)
    "trace_gym": ROOT / "trace_gym",
    "trace_gym.envs": ROOT / "envs",
    "trace_gym.allocators": ROOT / "allocators",
    "trace_gym.trainers": ROOT / "trainers",
}
PLUGINS = ("trace_gym.envs", "trace_gym.allocators", "trace_gym.trainers")

PUBLIC_API = {
    "AgentEnv", "EnvSnapshot", "EnvUnavailable", "Task", "TaskSource", "Tool", "tool", "env_ids", "make", "register",
    "Allocator", "Budget", "BudgetExceeded", "Forest", "History", "allocate_step", "make_allocator",
    "register_advantage", "register_allocator", "Generation", "Policy", "Predictor", "SamplingParams", "make_policy",
    "make_predictor", "register_policy", "register_predictor", "RolloutEngine", "RunSpec", "Step",
}


def is_plugin(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PLUGINS)


# ----------------------------------------------------------------------------- the graph

@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    where: str  # path:line of the import

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} ({self.where})"


def discover() -> dict[str, tuple[Path, bool]]:
    """Installed module name -> (source file, is a package)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for name, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            if not (path.parent / "__init__.py").exists():
                continue  # not part of a package (e.g. a script next to it)
            if any(not (folder.joinpath(*rel.parts[:i]) / "__init__.py").exists() for i in range(1, len(rel.parts))):
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            modules[".".join((name, *parts))] = (path, rel.name == "__init__")
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_main_guard(test: ast.expr) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def _imports(tree: ast.AST):
    """Import nodes anywhere in ``tree`` except the bodies of ``if TYPE_CHECKING:`` and of
    ``if __name__ == "__main__":`` (code that never runs when the module is imported)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and (_is_type_checking(node.test) or _is_main_guard(node.test)):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def build_graph() -> tuple[dict[str, tuple[Path, bool]], list[Edge]]:
    modules = discover()
    edges: list[Edge] = []
    for module, (path, is_pkg) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = module.split(".") if is_pkg else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    pkg = ".".join(base + ([node.module] if node.module else []))
                else:
                    pkg = node.module or ""
                targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in modules else pkg for a in node.names]
            for dst in dict.fromkeys(targets):
                if dst in modules and dst != module:
                    edges.append(Edge(module, dst, where))
    return modules, edges


def find_cycles(nodes: list[str], edges: list[Edge]) -> list[list[Edge]]:
    """One concrete cycle per strongly connected component with more than one module."""
    out: dict[str, list[Edge]] = {n: [] for n in nodes}
    for e in edges:
        out[e.src].append(e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    sccs: list[set[str]] = []
    counter = 0

    def strongconnect(v: str) -> None:  # Tarjan, iteratively to avoid deep recursion
        nonlocal counter
        work = [(v, iter(out[v]))]
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for e in it:
                w = e.dst
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(out[w])))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    sccs.append(comp)

    for n in sorted(nodes):
        if n not in index:
            strongconnect(n)

    cycles = []
    for comp in sccs:
        start = min(comp)
        # shortest path back to start inside the component (BFS)
        prev: dict[str, Edge] = {}
        frontier = [start]
        found: Edge | None = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for e in sorted(out[v], key=lambda e: e.dst):
                    if e.dst not in comp:
                        continue
                    if e.dst == start:
                        found = e
                        break
                    if e.dst not in prev:
                        prev[e.dst] = e
                        nxt.append(e.dst)
                if found is not None:
                    break
            frontier = nxt
        assert found is not None
        path = [found]
        while path[0].src != start:
            path.insert(0, prev[path[0].src])
        cycles.append(path)
    return cycles


def test_the_walker_sees_the_package():
    modules, edges = build_graph()
    assert {"trace_gym", "trace_gym.forest.forest", "trace_gym.envs", "trace_gym.allocators.trace",
            "trace_gym.trainers.rl"} <= set(modules)
    pairs = {(e.src, e.dst) for e in edges}
    assert ("trace_gym.forest", "trace_gym.forest.forest") in pairs  # package __init__ -> submodule
    assert ("trace_gym.allocators.trace", "trace_gym.allocators") in pairs  # from pkg import name
    assert any(src.startswith("trace_gym.envs") for src, _ in pairs)


def test_type_checking_imports_are_ignored():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\nif __name__ == '__main__':\n    import d\n")
    names = [n.names[0].name for n in _imports(tree) if isinstance(n, ast.Import)]
    assert sorted(names) == ["b", "c"]


def test_cycle_finder_names_the_cycle():
    edges = [Edge("a", "b", "a.py:1"), Edge("b", "c", "b.py:1"), Edge("c", "a", "c.py:1"), Edge("c", "d", "c.py:2")]
    (cycle,) = find_cycles(["a", "b", "c", "d"], edges)
    assert [e.src for e in cycle] == ["a", "b", "c"] and cycle[-1].dst == "a"


def test_no_import_cycles():
    modules, edges = build_graph()
    cycles = find_cycles(list(modules), edges)
    msg = "\n\n".join("import cycle:\n  " + "\n  ".join(map(str, c)) for c in cycles)
    assert not cycles, msg


def test_core_does_not_import_plugins():
    _, edges = build_graph()
    bad = [e for e in edges if not is_plugin(e.src) and is_plugin(e.dst)]
    assert not bad, ("the core imports plug-in packages (use a registry or an entry point):\n  "
                     + "\n  ".join(map(str, bad)))


# ----------------------------------------------------------------------------- the public API

def test_import_trace_gym_prints_the_public_api_and_stays_light():
    code = ("import json, sys, trace_gym; print(trace_gym.__all__); "
            "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('trace_gym.envs', "
            "'trace_gym.allocators', 'trace_gym.trainers', 'transformers'))))); "
            "print(json.dumps(dir(trace_gym)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    api_line, heavy_line, dir_line = proc.stdout.strip().splitlines()[-3:]
    api = ast.literal_eval(api_line)
    assert set(api) == PUBLIC_API and len(api) == len(PUBLIC_API)
    assert json.loads(heavy_line) == [], "import trace_gym imported torch or a plug-in package"
    shown = set(json.loads(dir_line))
    assert shown - {"__version__"} == PUBLIC_API, f"dir(trace_gym) shows more than the API: {sorted(shown - PUBLIC_API)}"


@pytest.mark.parametrize("name", sorted(PUBLIC_API))
def test_every_public_name_has_a_docstring(name):
    import trace_gym

    obj = getattr(trace_gym, name)
    doc = obj.__doc__ if inspect.isclass(obj) else inspect.getdoc(obj)
    assert doc and doc.strip(), f"trace_gym.{name} has no docstring"
    assert not doc.startswith(f"{name}("), f"trace_gym.{name} only has the dataclass-generated docstring"


# ----------------------------------------------------------------------------- docstrings everywhere

def missing_docstrings(module: str, path: Path) -> list[str]:
    """The public names defined in ``module`` (its source at ``path``) that have no docstring:
    the module itself, its functions and classes, and their classes' methods and properties.
    A method documented on a base class counts as documented (``inspect.getdoc`` inherits);
    a class whose only docstring is the dataclass-generated signature does not."""
    import importlib

    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    mod = importlib.import_module(module)
    out = [] if ast.get_docstring(tree) else [f"{module} (module)"]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            if not inspect.getdoc(getattr(mod, node.name)):
                out.append(f"{module}.{node.name}")
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            cls = getattr(mod, node.name)
            if not (cls.__doc__ or "").strip() or cls.__doc__.startswith(f"{node.name}("):
                out.append(f"{module}.{node.name} (class)")
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    if not inspect.getdoc(getattr(cls, item.name, None)):
                        out.append(f"{module}.{node.name}.{item.name}")
    return out


def test_missing_docstrings_finds_what_a_reader_would_miss(tmp_path, monkeypatch):
    src = tmp_path / "docless_mod.py"
    src.write_text('"""A module."""\nfrom dataclasses import dataclass\n\n'
                   "class Base:\n    \"\"\"Base.\"\"\"\n    def run(self):\n        \"\"\"Run.\"\"\"\n\n"
                   "class Child(Base):\n    \"\"\"Child.\"\"\"\n    def run(self):\n        pass\n"
                   "    def stop(self):\n        pass\n    @property\n    def size(self):\n        return 1\n"
                   "    def _private(self):\n        pass\n\n"
                   "@dataclass\nclass Plain:\n    x: int = 0\n\n"
                   "def helper():\n    pass\n\ndef _hidden():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert missing_docstrings("docless_mod", src) == [
        "docless_mod.Child.stop", "docless_mod.Child.size", "docless_mod.Plain (class)", "docless_mod.helper"]


def test_every_public_name_in_every_module_has_a_docstring():
    modules = {m: p for m, (p, _) in discover().items() if not m.endswith(".__main__")}
    missing = [name for m, p in modules.items() for name in missing_docstrings(m, p)]
    assert not missing, "public names without a docstring (say what the caller can rely on):\n  " + "\n  ".join(missing)
