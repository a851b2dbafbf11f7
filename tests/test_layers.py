"""Imports point one way: each layer of the package imports only from itself and the
layers below it (ARCHITECTURE.md), and nothing outside models/ tests a model's name.

Every import counts: module level, inside functions, under ``TYPE_CHECKING``, and
module paths handed to ``importlib`` as strings ("pkg.module" or "pkg.module:fn").
Pure AST, no imports of the package: under a second.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "raytrain_platform"

# Top to bottom. A layer is a top-level module or subpackage of raytrain_platform.
LAYERS: list[set[str]] = [
    {"__main__"},  # python -m raytrain_platform
    {"cli"},  # the rtp command: parse, call the API, exit codes
    {"__init__"},  # the public API (re-exports, lazily)
    {"tune", "serve", "doctor", "tools"},  # sweeps, HTTP, measured advice, offline makers
    {"launch"},  # the only place that builds TorchTrainer and datasets
    {"evaluation"},  # rtp eval: lm-evaluation-harness on an export (launch runs it after training)
    {"export"},  # checkpoints -> exported folders (safetensors, Hugging Face, PEFT)
    {"inference"},  # a run, checkpoint or export -> a model for inference (serve, export)
    {"core"},  # the training engine, checkpoints, the run directory (Ray-free)
    {"tracking"},  # MLflow and TensorBoard, fed by the engine's rank 0 (Ray-free)
    {"resolve"},  # config + data -> a runnable job
    {"plan"},  # the memory model and decision guide
    {"data"},  # sources, Ray Data pipelines, dealing
    {"config"},  # typed config and validation (no torch)
    {"parallel"},  # one file per strategy, composed in parallel/compose.py
    {"models"},  # model families
    {"compat"},  # torch's and Ray's private APIs, each in one place (tests/test_compat.py)
    {"units", "_version"},
    {"errors"},
]
_MODULE_STRING = re.compile(r"^raytrain_platform(\.\w+)+(:\w+)?$")


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _rank(layer: str) -> int:
    for i, members in enumerate(LAYERS):
        if layer in members:
            return i
    raise AssertionError(f"layer {layer!r} is not placed in LAYERS (tests/test_layers.py)")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1] if len(parts) > 2 else [parts[0], "__init__"]
    return ".".join(parts)


_MODULES = {".".join(p.relative_to(PKG.parent).with_suffix("").parts) for p in PKG.rglob("*.py")}


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import module` imports that module (and pkg/__init__ only as a package)
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in _MODULES]
            found += [(m, node.lineno) for m in subs] if len(subs) == len(node.names) else [(node.module, node.lineno)]
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.match(node.value):
            found.append((node.value.partition(":")[0], node.lineno))
    return [(m, line) for m, line in found if m == "raytrain_platform" or m.startswith("raytrain_platform.")]


def _edges() -> list[tuple[str, str, str]]:
    """(importing layer, imported layer, where) for every cross-layer import."""
    edges = []
    for path in sorted(PKG.rglob("*.py")):
        here = _layer_of(_module_name(path))
        for target, line in _imports(path):
            there = _layer_of(target) if target != "raytrain_platform" else "__init__"
            if there != here:
                edges.append((here, there, f"{path.relative_to(PKG.parent)}:{line} imports {target}"))
    return edges


def test_every_layer_is_placed():
    layers = {_layer_of(_module_name(p)) for p in PKG.rglob("*.py")}
    for layer in layers:
        _rank(layer)


def test_imports_point_down_only():
    upward = [where for here, there, where in _edges() if _rank(there) <= _rank(here)]
    assert not upward, "imports that point up or sideways between layers:\n" + "\n".join(upward)


def test_no_cycles_between_layers():
    graph: dict[str, set[str]] = {}
    for here, there, _ in _edges():
        graph.setdefault(here, set()).add(there)
    cycles = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets
                     if a in graph.get(b, set())})
    assert not cycles, f"layers importing each other: {cycles}"


def test_the_check_sees_function_level_and_type_only_imports(tmp_path):
    """The detector itself: hidden imports count (the cycles seen before were hidden so)."""
    src = tmp_path / "raytrain_platform" / "models" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from raytrain_platform.config import JobConfig\n"
                   "def f():\n    import raytrain_platform.launch.trainer\n"
                   "TARGET = 'raytrain_platform.serve.app:api'\n")
    assert [m for m, _ in _imports(src)] == ["raytrain_platform.config", "raytrain_platform.launch.trainer",
                                             "raytrain_platform.serve.app"]


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a package's own name is its __init__)."""
    def resolve(target: str) -> str | None:
        parts = target.split(".")
        while parts:
            name = ".".join(parts)
            if name in _MODULES:
                return name
            if f"{name}.__init__" in _MODULES:
                return f"{name}.__init__"
            parts.pop()
        return None

    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        here = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        graph[here] = {t for t in (resolve(m) for m, _ in _imports(path)) if t and t != here}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_modules():
    cycles = _cycles(_module_graph())
    assert not cycles, "modules importing each other (in a circle):\n" + "\n".join(map(str, cycles))


def test_the_cycle_check_finds_a_cycle_through_three_modules():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_private_name_is_imported_from_another_module():
    """A leading underscore means "this module's own": another module that needs it
    wants a public name (or the code in the right place)."""
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("raytrain_platform"):
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if names:
                    hits.append(f"{path.relative_to(PKG.parent)}:{node.lineno} imports {names} from {node.module}")
    assert not hits, "private names imported from another module:\n" + "\n".join(hits)


_NAME_TEST = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](gpt|mlp)["']|["'](gpt|mlp)["']\s*(==|!=)""")


def test_nothing_outside_models_tests_a_model_name():
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        if path.relative_to(PKG).parts[0] == "models":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _NAME_TEST.search(code) or re.search(r"""\(\s*["']gpt["']\s*,\s*["']mlp["']\s*\)""", code):
                hits.append(f"{path.relative_to(PKG.parent)}:{i}: {line.strip()}")
    assert not hits, "model names tested outside models/ (ask the family instead):\n" + "\n".join(hits)


# data/ in one direction, top to bottom (data/sources.py says why each module sits where it does).
DATA_LAYERS: list[set[str]] = [
    {"ray_data", "local"},  # Ray Data pipelines; the Ray-free torchrun reader
    {"dealing", "generate"},  # who reads which micro-batch; `rtp make-data`
    {"sources"},  # the front door
    {"mixed"},  # a mixture's dataset: its sources' datasets, drawn by mixture.py's plan
    {"tokenize_pass", "ref_logps"},  # the pass that writes a tokenized dataset; DPO's reference log-probs
    {"prepared"},  # a written dataset: key, manifest, windows
    {"pieces"},  # a tokenized source in pieces and blocks
    {"jsonl", "tables", "text_groups", "raw"},  # one reader per source
    {"parquet"},  # tabular Parquet (its files are listed for tables too)
    {"preference"},  # preference pairs as rows (data.format preference)
    {"encode", "packing", "mixture"},  # tokenizing records, packing documents, a mixture's plan
    {"specs"},  # plain specs
    {"splits"},  # file systems, the split's rules
    {"__init__"},
]


def test_data_imports_point_down_only():
    rank = {m: i for i, layer in enumerate(DATA_LAYERS) for m in layer}
    wrong = []
    for path in sorted((PKG / "data").glob("*.py")):
        here = path.stem
        assert here in rank, f"data/{path.name} is not placed in DATA_LAYERS (tests/test_layers.py)"
        for module, line in _imports(path):
            parts = module.split(".")
            if parts[:2] != ["raytrain_platform", "data"] or len(parts) < 3:
                continue
            if rank[parts[2]] < rank[here]:
                wrong.append(f"data/{path.name}:{line} imports data.{parts[2]}, a layer above it")
    assert not wrong, "\n".join(wrong)
