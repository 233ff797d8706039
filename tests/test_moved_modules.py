"""The old top-level module paths (the attention modules, moved to ``dash_trt.attention``; the
command lines, moved to ``dash_trt.commands``) are the same module objects for one release, served
by one table (:mod:`dash_trt._moved`) with no file at the old path, and nothing in the package
imports them by the old path."""

import ast
import importlib
import pathlib
import subprocess
import sys

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
    "models.qwen2_moe_dca": "models.qwen2_dca.moe",
    "cli": "commands.demo",
    "info": "commands.info",
    "ocr": "commands.ocr",
}
PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "dash_trt"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_moved_module(old):
    new = importlib.import_module(f"dash_trt.{MOVED[old]}")
    assert importlib.import_module(f"dash_trt.{old}") is new
    parent, _, leaf = f"dash_trt.{old}".rpartition(".")
    pkg = importlib.import_module(parent)
    assert getattr(pkg, leaf) is new  # `from dash_trt import paged` too
    assert sys.modules[f"dash_trt.{old}"] is new
    assert new.__spec__.name == new.__name__ == f"dash_trt.{MOVED[old]}"  # the alias left them alone
    assert not (PACKAGE / f"{old}.py").exists()  # the table serves it, no file


def test_every_import_form_of_an_old_path_in_a_fresh_interpreter():
    """The old path imported first, before anything imported the new one: each form of import gives
    the new path's module, loaded once."""
    code = """
import importlib, sys
import dash_trt.paged
from dash_trt.dca_ops import ATTRIBUTES
from dash_trt import info
new = importlib.import_module("dash_trt.attention.dash.paged")
assert dash_trt.paged is new, (dash_trt.paged, new)
assert importlib.import_module("dash_trt.dca_ops") is sys.modules["dash_trt.attention.dca.ops"]
assert ATTRIBUTES is sys.modules["dash_trt.attention.dca.ops"].ATTRIBUTES
assert info is sys.modules["dash_trt.commands.info"] and info.__spec__.name == "dash_trt.commands.info"
assert new.__spec__.name == "dash_trt.attention.dash.paged"
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_an_old_command_path_still_runs_with_python_m():
    run = lambda module: subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120
    )
    new, old = run("dash_trt.commands.info"), run("dash_trt.info")
    assert old.returncode == new.returncode == 0, old.stderr[-2000:]
    assert old.stdout == new.stdout and new.stdout.startswith("dash-trt ")


def test_an_unknown_name_is_still_not_found():
    import dash_trt

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dash_trt.nonexistent")
    with pytest.raises(ModuleNotFoundError):
        exec("import dash_trt.nonexistent", {})
    with pytest.raises(ImportError):
        exec("from dash_trt import nonexistent", {})
    with pytest.raises(AttributeError):
        dash_trt.nonexistent  # noqa: B018


def test_the_finder_is_installed_once():
    import dash_trt
    from dash_trt import _moved

    _moved.install()
    importlib.reload(dash_trt)
    assert sum(isinstance(f, _moved.MovedFinder) for f in sys.meta_path) == 1


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
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts)
        if path.name == "__init__.py":
            module += ".__init__"  # relative imports resolve against the package itself
        bad = _imported(ast.parse(path.read_text(encoding="utf-8")), module) & old_paths
        found += [f"{path.relative_to(PACKAGE.parent)}: {b}" for b in sorted(bad)]
    assert not found, found


def test_the_table_is_the_one_tested_here():
    from dash_trt._moved import MOVED as TABLE

    assert TABLE == {f"dash_trt.{old}": f"dash_trt.{new}" for old, new in MOVED.items()}
