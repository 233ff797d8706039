"""Old module paths, kept for one release: each old name is the very module of its new path.

``import dash_trt.paged``, ``from dash_trt import paged`` and ``import_module("dash_trt.paged")``
all give :mod:`dash_trt.attention.dash.paged` itself, not a copy; ``python -m dash_trt.info`` runs
:mod:`dash_trt.commands.info`. ``dash_trt`` installs :class:`MovedFinder` once, at its import; a
new path is imported only when its old name is asked for.
"""

from __future__ import annotations

import importlib
import sys
from importlib.machinery import ModuleSpec

#: old module name -> the module it now is
MOVED = {
    "dash_trt.attributes": "dash_trt.attention.dash.attributes",
    "dash_trt.config": "dash_trt.attention.dash.config",
    "dash_trt.cuda": "dash_trt.attention.dash.cuda",
    "dash_trt.onnx_ops": "dash_trt.attention.dash.onnx",
    "dash_trt.ops": "dash_trt.attention.dash.ops",
    "dash_trt.paged": "dash_trt.attention.dash.paged",
    "dash_trt.reference": "dash_trt.attention.dash.reference",
    "dash_trt.dca": "dash_trt.attention.dca.reference",
    "dash_trt.dca_onnx": "dash_trt.attention.dca.onnx",
    "dash_trt.dca_ops": "dash_trt.attention.dca.ops",
    "dash_trt.dca_paged": "dash_trt.attention.dca.paged",
    "dash_trt.models.qwen2_moe_dca": "dash_trt.models.qwen2_dca.moe",
    "dash_trt.cli": "dash_trt.commands.demo",
    "dash_trt.info": "dash_trt.commands.info",
    "dash_trt.ocr": "dash_trt.commands.ocr",
}


class MovedFinder:
    """A finder and loader of the names of :data:`MOVED` alone: loading an old name imports its new
    path and hands that module over, so ``sys.modules`` holds one module under both names."""

    def find_spec(self, fullname, path=None, target=None):
        return ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import machinery sets module.__spec__ = spec
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # the new path's import ran it; its spec again

    def get_code(self, fullname):
        """``python -m dash_trt.info``: runs the new path as ``__main__``."""
        return compile(
            f"import runpy; runpy.run_module({MOVED[fullname]!r}, run_name='__main__', alter_sys=True)",
            fullname,
            "exec",
        )


def install() -> None:
    """Put one :class:`MovedFinder` on ``sys.meta_path`` (a second call adds none)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())


def __getattr__(name: str):
    """``dash_trt``'s module ``__getattr__``: ``dash_trt.paged`` after a bare ``import dash_trt``."""
    if f"dash_trt.{name}" in MOVED:
        return importlib.import_module(f"dash_trt.{name}")
    raise AttributeError(f"module 'dash_trt' has no attribute {name!r}")
