"""The private torch, Ray, transformers and peft APIs the package uses live in raytrain_platform/compat/,
each named with why; every one of them resolves in the installed versions (an upgrade
that removes or moves one fails here, by name), and nothing else in the package or the
benchmarks reaches a private torch or Ray name. Pure AST for the second part."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from raytrain_platform.compat import hf_private, ray_private, torch_private

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("entry", sorted(torch_private.USED))
def test_every_private_torch_api_used_resolves(entry):
    assert torch_private.resolve(entry) is not None


@pytest.mark.parametrize("entry", sorted(hf_private.USED))
def test_every_private_transformers_or_peft_api_used_resolves(entry):
    assert hf_private.resolve(entry) is not None


@pytest.mark.parametrize("entry", sorted(ray_private.USED))
def test_every_private_ray_api_used_resolves(entry):
    assert ray_private.resolve(entry) is not None


def test_the_job_config_variable_is_rays_own():
    assert ray_private.resolve("ray._private.runtime_env.constants:RAY_JOB_CONFIG_JSON_ENV_VAR") == \
        ray_private.JOB_CONFIG_ENV


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] in ("torch", "ray", "transformers", "peft") and any(p.startswith("_") and not p.startswith("__") for p in parts)


def _dotted(node: ast.AST) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(names)])
    return None


def private_uses(path: Path) -> list[str]:
    """Each import of, or attribute path through, a private torch or Ray name in `path`;
    also an assignment to a private attribute of a Ray DataContext (``ctx._x = ...``)."""
    hits: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        found = None
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found = next((n for n in names if _private(n)), None)
        elif isinstance(node, ast.Import):
            found = next((a.name for a in node.names if _private(a.name)), None)
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            found = dotted if dotted and _private(dotted) else None
            if found is None and node.attr.startswith("_max_num_blocks"):
                found = node.attr
        if found:
            hits.append((node.lineno, f"{path.relative_to(ROOT)}:{node.lineno}: {found}"))
    return [hit for _, hit in sorted(hits)]


def test_nothing_outside_compat_reaches_a_private_torch_or_ray_name():
    files = [p for p in sorted((ROOT / "raytrain_platform").rglob("*.py")) if "compat" not in p.parts]
    files += sorted((ROOT / "benchmarks").glob("*.py"))
    hits = [hit for path in files for hit in private_uses(path)]
    assert not hits, "private APIs outside raytrain_platform/compat/:\n" + "\n".join(hits)


def test_the_scan_sees_imports_attributes_and_the_data_context(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("import torch._dynamo\nfrom ray._private.state import f\nimport torch\n"
                   "torch._foreach_norm([])\nctx._max_num_blocks_in_streaming_gen_buffer = 1\n"
                   "torch.nn.utils.get_total_norm([])\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert [h.split(": ")[1] for h in private_uses(src)] == [
            "torch._dynamo", "ray._private.state.f", "torch._foreach_norm", "_max_num_blocks_in_streaming_gen_buffer"]
    finally:
        ROOT = root
