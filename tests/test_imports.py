"""No import circles among symmem's modules.

Data flows one way (model -> graph -> plan -> passes -> counter -> estimate -> questions
and outputs), and the imports should say so: a module never imports, directly or through
others, a module that imports it. Imports inside functions count too (a late import
hides a circle from Python, not from the reader). A package's ``__init__`` importing its
own submodules is not a circle of ideas and is left out.

The graph is read from the source with ``ast``; nothing is imported.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "symmem"


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the package (``pkg.__init__``
    is named ``pkg``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file (module level,
    functions, methods, ``if TYPE_CHECKING`` blocks alike)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:           # from . import x, from ..a import b
                base = package[:len(package) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # ``from pkg import sub`` imports the submodule pkg.sub when there is one
            targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:     # symmem.engine.canonical -> symmem.engine
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph = {m: imported(m, p, set(mods)) for m, p in mods.items()}
    # a package's __init__ importing its own submodules: not a circle of ideas
    return {m: {n for n in deps if not n.startswith(m + ".")} for m, deps in graph.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each
    sorted, in sorted order."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _path(graph, comp) -> str:
    """One cycle through the first module of ``comp``, to show how the circle closes."""
    start, members = comp[0], set(comp)
    seen, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    hops = [v]
                    while seen[hops[-1]] is not None:
                        hops.append(seen[hops[-1]])
                    return " -> ".join([*reversed(hops), start])
                if w not in seen:
                    seen[w] = v
                    nxt.append(w)
        frontier = nxt
    return ", ".join(comp)


# ----------------------------------------------------------------------------- the finder

def test_the_finder_sees_function_level_imports_and_relative_forms(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\nfrom .sub import c\n")
    (pkg / "a.py").write_text("import os\nfrom .b import thing\n")
    (pkg / "b.py").write_text("def late():\n    from . import a\n    return a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..a import x\nfrom pkg.sub import d\n")
    (pkg / "sub" / "d.py").write_text("import pkg.b\n")
    mods = modules(pkg)
    assert set(mods) == {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "pkg.sub.d"}
    graph = {m: imported(m, p, set(mods)) for m, p in mods.items()}
    assert graph["pkg"] == {"pkg.a", "pkg.sub", "pkg.sub.c"}
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg", "pkg.a"}          # "from . import a" names pkg and pkg.a
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.sub", "pkg.sub.d"}
    assert graph["pkg.sub.d"] == {"pkg.b"}
    # pkg -> a -> b -> pkg, and pkg -> sub.c -> sub.d -> b; pkg.sub imports nothing
    assert circles(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.sub.c", "pkg.sub.d"]]
    assert circles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert _path({"x": {"y"}, "y": {"x"}}, ["x", "y"]) == "x -> y -> x"


# ----------------------------------------------------------------------------- symmem

def test_every_module_is_seen():
    mods = modules()
    for name in ("symmem", "symmem.engine", "symmem.printing", "symmem.render", "symmem.errors",
                 "symmem.units", "symmem.cli"):
        assert name in mods
    graph = import_graph()
    assert "symmem.printing" in graph["symmem.engine"]        # a known edge, as a sanity check


def test_no_import_circles():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(
        f"  {', '.join(comp)}  (e.g. {_path(graph, comp)})" for comp in found)


def test_presentation_is_a_leaf_of_the_computation():
    """printing and the units import nothing that computes; errors only the units."""
    graph = import_graph()
    assert graph["symmem.units"] == set()
    assert graph["symmem.errors"] <= {"symmem.units"}
    assert graph["symmem.printing"] <= {"symmem.symbols", "symmem.units"}


# ----------------------------------------------------------------------------- import cost

def _modules_after(code: str) -> set[str]:
    """The top-level packages in sys.modules after running ``code`` in a fresh interpreter."""
    import os
    import subprocess
    import sys
    root = str(Path(__file__).resolve().parents[1])
    probe = code + "\nimport sys; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": root}, cwd=root).stdout
    return set(out.split())


def test_import_symmem_imports_nothing_heavy():
    """``import symmem`` is lazy (PEP 562): sympy, numpy and the rest come with the first name used."""
    loaded = _modules_after("import symmem")
    assert not loaded & {"sympy", "numpy", "networkx", "torch", "matplotlib", "jinja2"}, loaded


def test_deriving_imports_no_plotting_graphs_or_torch():
    loaded = _modules_after("import symmem as sm\nsm.estimate('gpt2', sm.Policy('bf16-mixed', 'adamw'))")
    assert "sympy" in loaded
    assert not loaded & {"networkx", "torch", "matplotlib", "jinja2"}, loaded


def test_the_lazy_names_are_the_modules_own():
    import symmem
    from symmem import Policy, engine, errors, graph, models, rules, symbols
    assert symmem.estimate is engine.estimate and symmem.Estimate is engine.Estimate
    assert Policy is symmem.policy.Policy and symmem.rule is rules.rule
    assert symmem.models is models and symmem.symbols is symbols and symmem.Graph is graph.Graph
    assert symmem.ConfigError is errors.ConfigError
    assert set(symmem.__all__) <= set(dir(symmem))
    assert all(hasattr(symmem, name) for name in symmem.__all__)
    try:
        symmem.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_to_networkx_imports_networkx_when_asked():
    loaded = _modules_after("import symmem as sm\nsm.models.preset('gpt2').to_networkx()")
    assert "networkx" in loaded
