"""The package's import graph: no loop (imports inside functions count: a loop closed
only at call time still ties the modules together), and no underscore name of one
package module imported by another (a private helper another module needs is that
module's public API, under a public name). Parsed with ast, nothing imported."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ppo_kernels"
PKG = "ppo_kernels"
TRITON = ROOT.parent / "triton_kernels"


def _module_name(path):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules():
    mods = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    # the top-level triton_kernels/ is installed as ppo_kernels.triton_kernels
    # (pyproject.toml package-dir)
    for p in sorted(TRITON.glob("*.py")):
        sub = "" if p.stem == "__init__" else "." + p.stem
        mods[f"{PKG}.triton_kernels{sub}"] = p
    return mods


def _resolve(current, is_package, level, module):
    """The absolute name of `from <level dots><module> import ...` in module current."""
    if level == 0:
        return module
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _bound_names(path):
    """The names a module binds at its top level (imports, defs, assignments)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _edges(modules):
    """(importer, imported module, name or None, line) for every import of a package
    module, at the top of a file or inside a function."""
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == PKG or a.name.startswith(PKG + "."):
                        target = a.name
                        while target not in modules and "." in target:
                            target = target.rsplit(".", 1)[0]
                        out.append((name, target, None, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                if not (base == PKG or base.startswith(PKG + ".")):
                    continue
                bound = _bound_names(modules[base]) if base in modules else set()
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in modules or (modules.get(base, ROOT).name == "__init__.py"
                                          and a.name not in bound):
                        # `from . import x`: the module x itself (a name the package's
                        # __init__ does not bind is a compiled module, _C: a leaf)
                        out.append((name, sub, None, node.lineno))
                    else:
                        target = base
                        while target not in modules and "." in target:
                            target = target.rsplit(".", 1)[0]
                        out.append((name, target, a.name, node.lineno))
    return out


MODULES = _modules()
EDGES = _edges(MODULES)


def test_the_parse_sees_the_package():
    assert "ppo_kernels.loss" in MODULES and "ppo_kernels.triton_kernels.sampling" in MODULES
    assert any(e[0] == "ppo_kernels.loss" for e in EDGES)


def test_no_private_name_is_imported_across_modules():
    bad = [f"{src}:{line} imports {name} from {dst}" for src, dst, name, line in EDGES
           if name is not None and name.startswith("_") and not name.startswith("__")
           and src != dst]
    assert not bad, "\n".join(bad)


def _cycles(graph):
    """The strongly connected components with more than one module (Tarjan), or a
    module importing itself."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_loop():
    graph = {}
    for src, dst, _, _ in EDGES:
        if dst != src:
            graph.setdefault(src, set()).add(dst)
    loops = _cycles(graph)
    if loops:
        lines = []
        for comp in loops:
            members = set(comp)
            lines.append(" <-> ".join(comp) + ":")
            lines += [f"    {s}:{ln} -> {d}" for s, d, _, ln in EDGES
                      if s in members and d in members and s != d]
        pytest.fail("import loops:\n" + "\n".join(lines))


def test_repository_layout():
    """The root holds the layout the project was specified with; the Triton sources are
    the top-level triton_kernels/, mapped into the package by pyproject.toml (so no copy
    under ppo_kernels/ and no top-level name in an installed wheel: test_install.py)."""
    top = ROOT.parent
    for name in ("setup.py", "csrc", "ppo_kernels", "triton_kernels", "tests", "benchmarks",
                 "README.md"):
        assert (top / name).exists(), name
    assert not (ROOT / "triton_kernels").exists()
    toml = (top / "pyproject.toml").read_text()
    assert 'package-dir = {"ppo_kernels.triton_kernels" = "triton_kernels"}' in toml
