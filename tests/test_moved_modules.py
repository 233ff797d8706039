"""The attention modules' old top-level paths (moved to ``dash_trt.attention``) are the same
module objects for one release, and nothing in the package imports them by the old path."""

import ast
import importlib
import pathlib

import pytest

MOVED = {
    "config": "attention.dash.config",
    "reference": "attention.dash.reference",
    "paged": "attention.dash.paged",
    "ops": "attention.dash.ops",
    "onnx_ops": "attention.dash.onnx",
    "cuda": "attention.dash.cuda",
    "attributes": "attention.dash.attributes",
    "dca": "attention.dca.reference",
    "dca_paged": "attention.dca.paged",
    "dca_ops": "attention.dca.ops",
    "dca_onnx": "attention.dca.onnx",
}
PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "dash_trt"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_moved_module(old):
    new = importlib.import_module(f"dash_trt.{MOVED[old]}")
    assert importlib.import_module(f"dash_trt.{old}") is new
    pkg = importlib.import_module("dash_trt")
    assert getattr(pkg, old) is new  # `from dash_trt import paged` too


def _imported(tree: ast.AST, module: str) -> set[str]:
    """Absolute names of the modules a file imports (relative ones resolved against ``module``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: -node.level]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def test_the_package_imports_the_new_paths():
    old_paths = {f"dash_trt.{o}" for o in MOVED}
    shims = {PACKAGE / f"{o}.py" for o in MOVED}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path in shims:
            continue
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts)
        if path.name == "__init__.py":
            module += ".__init__"  # relative imports resolve against the package itself
        bad = _imported(ast.parse(path.read_text(encoding="utf-8")), module) & old_paths
        found += [f"{path.relative_to(PACKAGE.parent)}: {b}" for b in sorted(bad)]
    assert not found, found
