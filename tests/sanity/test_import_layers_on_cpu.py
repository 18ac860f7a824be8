"""The package's import graph: no cycle, and every import (module level or inside a function) points down the
layers below. A new module gets a layer here; an import that climbs a layer or closes a cycle fails this test.

    0 algos                       the math, pure torch
    1 shapes, models, distributed, process_log, prompt_files   the shapes world; one adapter per architecture;
                                  process set-up; prompt files read into rows
    2 rewards, data_process, config   rewards; prompt sets → parquet; the YAML and its typed schema (config/schema.py)
    3 rollout, export.writer/shards   samplers and replicas; writing a model diffusers loads
    4 workers                     the actor worker and its engine
    5 trainer                     verl's V1 trainers, run directory, validation
    6 registry, plugin, hardware, run_setup   registration into verl; preparing and checking a run; estimates
    7 main_flowgrpo, sample, export (CLI), recipe_sources, check   entry points
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "verl_diffusion"

LAYERS = [
    ("algos", 0), ("shapes", 1), ("models", 1), ("distributed", 1), ("process_log", 1), ("notices", 1), ("prompt_files", 1),
    ("rewards", 2), ("data_process", 2), ("data", 2), ("config", 2), ("assets", 2),
    ("rollout", 3), ("export.writer", 3), ("export.shards", 3),
    ("workers", 4),
    ("trainer", 5),
    ("registry", 6), ("plugin", 6), ("hardware", 6), ("run_setup", 6), ("launch", 6), ("recipe_index", 6),
    ("main_flowgrpo", 7), ("sample", 7), ("export", 7), ("recipe_sources", 7), ("check", 7),
]


def layer(module: str) -> int:
    rel = module[len("verl_diffusion."):] if module != "verl_diffusion" else ""
    best = None
    for prefix, rank in LAYERS:
        if rel == prefix or rel.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, rank)
    assert best is not None, f"{module} has no layer: add it to LAYERS in {__file__}"
    return best[1]


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module → the package modules it imports anywhere in its file (functions included)."""
    edges = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            found = []
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                found = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in found:
                while target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in mods and target != name and target.startswith("verl_diffusion."):
                    targets.add(target)
        edges[name] = targets
    return edges


def test_no_import_cycle():
    edges = imports(modules())
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v, counter=[0]):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                cycles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_imports_point_down_the_layers():
    edges = imports(modules())
    upward = sorted(f"{a} ({layer(a)}) -> {b} ({layer(b)})" for a, targets in edges.items() for b in targets
                    if layer(b) > layer(a))
    assert not upward, "imports that climb a layer:\n" + "\n".join(upward)
