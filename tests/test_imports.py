"""Package boundaries, read from the source (ast: nothing is imported, so no import side effects).

The layers: neutral modules (`spanllm.dtypes`, `spanllm.cuda_graph`, `spanllm.measure`) import nothing of
spanllm but each other; the kernels (`spanllm.kernels`: every @triton.jit) import nothing of spanllm but
neutral modules; the libraries (every package but `commands`) import neither the command modules
(`spanllm.commands`, `spanllm.cli`) nor argparse; the packages together have no import cycle. Imports inside
functions count:
a lazy import is still a dependency. Top-level modules (`errors`, `checks`, `launch`) are shared plumbing,
outside the package check: `errors` and `checks` look up the libraries' exception classes and tables lazily.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "spanllm"
PACKAGES = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())
NEUTRAL = {"dtypes", "cuda_graph", "measure"}
LIBRARIES = ("comm", "engine", "perf", "model", "layers", "attention", "kernels", "bench", "serve")
COMMANDS = ("commands", "cli")


def unit(module: str) -> str | None:
    """spanllm.comm.nvrar.allreduce -> 'comm'; spanllm.launch -> 'launch'; other projects -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "spanllm" and len(parts) > 1 else None


def imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
            if node.module == "spanllm":  # from spanllm import checks (not: from spanllm import __version__)
                out += [
                    (f"spanllm.{a.name}", node.lineno)
                    for a in node.names
                    if (ROOT / a.name).is_dir() or (ROOT / f"{a.name}.py").exists()
                ]
    return out


def edges() -> dict[str, dict[str, str]]:
    """unit -> {imported unit: 'file:line' of the first import that makes the edge}."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        src = unit("spanllm." + ".".join(path.relative_to(ROOT).with_suffix("").parts))
        if src is None or src == "__init__":
            continue
        for module, line in imports(path):
            dst = unit(module)
            if dst is not None and dst != src:
                graph.setdefault(src, {}).setdefault(dst, f"{path.relative_to(ROOT.parent)}:{line}")
    return graph


def cycles_between(graph: dict[str, dict[str, str]], nodes: set[str]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan), each as a closed path through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return groups


def describe(group: list[str], graph: dict[str, dict[str, str]]) -> str:
    return "; ".join(f"{a} -> {b} ({graph[a][b]})" for a in group for b in group if b in graph.get(a, {}))


def test_no_import_cycle_between_packages():
    graph = edges()
    found = cycles_between(graph, set(PACKAGES))
    assert not found, "import cycle between packages: " + " | ".join(describe(g, graph) for g in found)


def test_neutral_modules_import_only_each_other():
    graph = edges()
    bad = {f"{a} -> {b} ({where})" for a in NEUTRAL for b, where in graph.get(a, {}).items() if b not in NEUTRAL}
    assert not bad, f"neutral modules must not depend on the rest of spanllm: {sorted(bad)}"


@pytest.mark.parametrize("library", LIBRARIES)
def test_libraries_do_not_import_commands(library):
    graph = edges()
    bad = {
        f"{library} -> {b} ({where})" for b, where in graph.get(library, {}).items() if b in ("bench", "serve", "cli")
    }
    assert not bad, f"a library imports a command-line package: {sorted(bad)}"
    argparse_users = [
        f"{p.relative_to(ROOT.parent)}:{line}"
        for p in sorted((ROOT / library).rglob("*.py"))
        for module, line in imports(p)
        if module == "argparse"
    ]
    assert not argparse_users, (
        f"command-line code in the library package {library}: {argparse_users}; "
        "command modules live in spanllm/commands"
    )


def test_kernels_import_only_neutral_modules():
    graph = edges()
    bad = {f"kernels -> {b} ({where})" for b, where in graph.get("kernels", {}).items() if b not in NEUTRAL}
    assert not bad, f"the kernels must not depend on the engine: {sorted(bad)}"


def test_the_checker_sees_a_cycle():
    graph = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:2"}, "c": {"a": "c.py:3"}, "d": {"a": "d.py:4"}}
    found = cycles_between(graph, {"a", "b", "c", "d"})
    assert found == [["a", "b", "c"]]
    assert describe(found[0], graph) == "a -> b (a.py:1); b -> c (b.py:2); c -> a (c.py:3)"
