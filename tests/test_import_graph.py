"""The package's imports form no circle and point down the flow.

The graph is read from the source with `ast` (nothing is imported): every `import` and
`from ... import` anywhere in a module, at module level, inside functions or under
`TYPE_CHECKING`, relative ones included, is an edge to the nanovllm module it names (a
`from package import name` where `name` is a submodule is an edge to that submodule). The
flow, top to bottom: entrypoints -> llm / engine -> executor -> runner / fastpath -> models ->
layers / attention -> kernels; leaf modules (step data, config, loaders, ...) import nothing
above them and may be imported from anywhere.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanovllm"

# Module-name prefix -> rank in the flow; an import may only go to an equal or lower rank.
RANKS = {
    "nanovllm.__main__": 8,
    "nanovllm.entrypoints": 7,
    "nanovllm": 6,  # the package's lazy `LLM` export
    "nanovllm.llm": 6,
    "nanovllm.engine": 6,
    "nanovllm.executor": 5,
    "nanovllm.runner": 4,
    "nanovllm.fastpath": 3,  # below the runner, which asks it; it imports only what is below
    "nanovllm.models": 2,
    "nanovllm.layers": 1,
    "nanovllm.attention": 1,
    "nanovllm.structured": 1,  # grammars: the engine keeps the matchers, the sampler applies the masks
    "nanovllm.attention.kernels": 0,
    # leaves: rank 0, importable from anywhere
    "nanovllm.step": 0,
    "nanovllm.step_result": 0,
    "nanovllm.attention.metadata": 0,
    "nanovllm.sampling_params": 0,
    "nanovllm.config": 0,
    "nanovllm.outputs": 0,
    "nanovllm.distributed": 0,
    "nanovllm.precompile": 0,
    "nanovllm.gc_pause": 0,
    "nanovllm.loaders": 0,
}
# Below the device layers: nothing here may import runner, executor, engine or entrypoints.
LOWER = ("nanovllm.layers", "nanovllm.attention", "nanovllm.models")
UPPER = ("nanovllm.runner", "nanovllm.fastpath", "nanovllm.executor", "nanovllm.engine", "nanovllm.entrypoints")
# Pure-Python scheduling: no torch, directly or through another nanovllm module.
TORCH_FREE = ("nanovllm.step", "nanovllm.engine.scheduler", "nanovllm.engine.block_manager", "nanovllm.engine.sequence")


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(nanovllm modules, top-level outside packages) that module `name` imports anywhere."""
    is_package = path.name == "__init__.py"
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "nanovllm":
                    inside.add(alias.name)
                else:
                    outside.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "nanovllm":
                outside.add(target.split(".")[0])
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                inside.add(sub if sub in modules else target)
    unknown = inside - set(modules)
    assert not unknown, f"{name} imports modules that do not exist: {sorted(unknown)}"
    inside.discard(name)
    return inside, outside


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = module_names()
    edges, external = {}, {}
    for name, path in modules.items():
        edges[name], external[name] = imports_of(name, path, modules)
    return edges, external


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def rank(name: str) -> int:
    best = max((p for p in RANKS if name == p or name.startswith(p + ".")), key=len)
    return RANKS[best]


def in_any(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_no_import_cycles():
    found = cycles(graph()[0])
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_point_down():
    edges, _ = graph()
    upward = [f"{a} -> {b}" for a, targets in sorted(edges.items()) for b in sorted(targets) if rank(b) > rank(a)]
    assert not upward, "imports against the flow:\n" + "\n".join(upward)


def test_model_layers_import_nothing_above_them():
    edges, _ = graph()
    bad = [f"{a} -> {b}" for a, targets in sorted(edges.items()) if in_any(a, LOWER)
           for b in sorted(targets) if in_any(b, UPPER)]
    assert not bad, "\n".join(bad)


def test_scheduling_is_torch_free():
    edges, external = graph()
    for start in TORCH_FREE:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            assert "torch" not in external[m], f"{start} imports torch (through {m})"
            todo.extend(edges[m])


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_checker_reads_every_kind_of_import(tmp_path):
    """Relative imports, `from package import submodule`, and imports inside functions and under
    TYPE_CHECKING are all edges."""
    source = tmp_path / "mod.py"
    source.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from ..other import thing\n"
        "if TYPE_CHECKING:\n"
        "    from nanovllm.typed import T\n"
        "def f():\n"
        "    import nanovllm.late\n"
        "    import torch\n"
    )
    modules = dict.fromkeys(["nanovllm.pkg.mod", "nanovllm.pkg.sibling", "nanovllm.other", "nanovllm.typed",
                             "nanovllm.late"], source)
    inside, outside = imports_of("nanovllm.pkg.mod", source, modules)
    assert inside == {"nanovllm.pkg.sibling", "nanovllm.other", "nanovllm.typed", "nanovllm.late"}
    assert {"torch", "typing", "__future__"} <= outside
