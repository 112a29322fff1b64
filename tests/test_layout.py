"""The package's layering, checked on the source with ``ast`` (nothing is imported, so it is fast).

Lower layers never import higher ones, so each layer can be read, tested and reused without the
ones above it, and no import circle can hide behind a function-local import. The layers, lowest
first: base, model, policy, engine, tools, top (the CLI).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "dflash"

# Module names relative to the package; a trailing ".*" names a subpackage and all its modules.
LAYERS: dict[str, set[str]] = {
    "base": {"errors", "console", "files", "backend", "workers", "ranks", "distributed"},
    "model": {"target", "drafter", "checkpoint", "sampling", "prompts", "gguf_import",
              "default_pair", "tree", "lookup", "dflash2", "ragged_cache", "grammar", "logprobs",
              "cache_files"},
    # What to verify each cycle and what it costs: pure decisions, below the engines that run them.
    "policy": {"policy.*", "cost_model"},
    "engine": {"model_mlx", "pair", "settings", "request", "speculative", "batch", "batch_pass", "prompt_cache",
               "acceptance", "stats"},
    "tools": {"serving.*", "training.*", "bench", "bench_runs", "bench_report", "bench_trace",
              "bench_concurrency", "convert", "convert_plan", "convert_card", "export", "tau",
              "bound", "contexts", "traces"},
    "top": {"cli", "cli_args", "cli_generate", "cli_serve", "cli_bench", "__main__"},
}
ORDER = list(LAYERS)
# ``dflash/__init__.py`` (the package itself, "") imports nothing: ``import dflash`` has no effect.
PACKAGE_INIT_IMPORTS: set[str] = set()
CLI_IMPORTERS = {"__main__", "cli"}
# Imports that break a rule but are kept for now, each with the reason (the lead decides).
ALLOWED: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    """``dflash/serving/app.py`` -> ``serving.app``; ``dflash/__init__.py`` -> ``""``."""
    parts = list(path.relative_to(PACKAGE_DIR).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def layer_of(name: str) -> str:
    if name == "":
        return "base"
    for layer, members in LAYERS.items():
        for member in members:
            if name == member or (member.endswith(".*") and
                                  (name + ".").startswith(member[:-1])):
                return layer
    raise AssertionError(f"dflash.{name} is in no layer: add it to LAYERS in {__file__}")


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, module_level: bool):
    """Import nodes; ``module_level``: only those run on import (not in functions/TYPE_CHECKING)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if module_level and (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                    ast.Lambda)) or _is_type_checking(child)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def internal_imports(name: str, path: Path, modules: dict[str, Path],
                     module_level: bool = False) -> set[str]:
    """The dflash modules ``name`` imports (``from pkg import sub`` counts as importing ``sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _imports(ast.parse(path.read_text(), str(path)), module_level):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif node.level:
            base = package.split(".") if package else []
            base = base[:len(base) - (node.level - 1)]
            targets = [(".".join(["dflash", *base, *([node.module] if node.module else [])]),
                        node.names)]
        else:
            targets = [(node.module or "", node.names)]
        for absolute, names in targets:
            if absolute != "dflash" and not absolute.startswith("dflash."):
                continue
            target = absolute[len("dflash."):] if absolute != "dflash" else ""
            subs = [f"{target}.{a.name}".lstrip(".") for a in names or []]
            subs = [s for s in subs if s in modules]
            found.update(subs or [target])
    found.discard(name)
    return found


@functools.cache  # parsed once for all the tests below
def import_graph(module_level: bool = False) -> dict[str, set[str]]:
    modules = all_modules()
    return {name: internal_imports(name, path, modules, module_level)
            for name, path in modules.items()}


def _label(name: str) -> str:
    return f"dflash.{name}" if name else "dflash"


def test_every_module_has_a_layer():
    for name in all_modules():
        layer_of(name)


def test_no_import_cycle_at_module_level():
    graph = import_graph(module_level=True)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(map(_label, cycle)))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_only_the_entry_points_import_the_cli():
    importers = {name for name, deps in import_graph().items() if "cli" in deps}
    assert importers <= CLI_IMPORTERS, sorted(map(_label, importers - CLI_IMPORTERS))


def test_layers_only_import_downwards():
    bad = []
    for name, deps in import_graph().items():
        if name == "":
            bad += [("dflash", _label(d)) for d in deps - PACKAGE_INIT_IMPORTS]
            continue
        rank = ORDER.index(layer_of(name))
        for dep in sorted(deps):
            dep_rank = ORDER.index(layer_of(dep))
            if dep_rank > rank and (name, dep) not in ALLOWED:
                bad.append((f"{_label(name)} ({ORDER[rank]})",
                            f"{_label(dep)} ({ORDER[dep_rank]})"))
    assert not bad, "upward imports: " + "; ".join(f"{a} imports {b}" for a, b in bad)


def test_the_checker_sees_relative_and_function_level_imports():
    # The rules above are only as good as the import reader: check it on the real tree.
    graph = import_graph()
    assert "cli" in graph["__main__"]
    assert "backend" in graph["target"]
    assert "serving.app" in graph["serving"]  # ``from .app import ...``
    assert "target" in graph["pair"]  # imported inside load_pair
    assert "target" not in import_graph(module_level=True)["pair"]
    assert "policy.plan" in graph["policy.auto"]  # ``from .plan import ...`` in a subpackage
    assert "policy" in graph["speculative"]
