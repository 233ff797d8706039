"""Where this installation keeps its shared libraries (the CUDA kernels, the TensorRT plugin).
Needs neither torch nor TensorRT: ``dash-build --help`` and ``--print-trtexec`` find the plugin
through it on a machine with neither."""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

__all__ = ["PLUGIN_NAME", "STATIC_PLUGIN_NAME", "installed_paths", "plugin_path", "plugin_tensorrt_version"]


def installed_paths(name: str) -> list[Path]:
    """Where this installation keeps the shared library ``name``, in search order:
    ``dash_trt/lib/`` of the package (wheels and ``pip install .``), the same folder under the
    interpreter's platlib, then ``build*/`` folders of a source checkout."""
    here = Path(__file__).resolve().parent
    found = [here / "lib" / name, Path(sysconfig.get_paths()["platlib"]) / "dash_trt" / "lib" / name]
    return found + sorted(Path(p) for p in glob.glob(str(here.parent / ("build*/**/" + name)), recursive=True))


PLUGIN_NAME = "libdash_trt_plugin.so"
#: The plugin that registers itself on load (Triton's TensorRT backend, trtexec --staticPlugins).
STATIC_PLUGIN_NAME = "libdash_trt_plugin_static.so"


def plugin_path(name: str = PLUGIN_NAME) -> Path | None:
    """The TensorRT plugin library ``name`` that ships with this installation, or None:
    ``$DASH_TRT_PLUGIN`` (for ``libdash_trt_plugin.so``; the static plugin is looked for beside
    it), then ``dash_trt/lib/`` of the installed package (wheels carry both), then ``build*/``
    folders of a source checkout."""
    env = os.environ.get("DASH_TRT_PLUGIN")
    if env:
        path = Path(env) if name == PLUGIN_NAME else Path(env).with_name(name)
        return path if path.is_file() else None
    return next((p for p in installed_paths(name) if p.is_file()), None)


def plugin_tensorrt_version(path: str | os.PathLike) -> tuple[int, int] | None:
    """(major, minor) of the TensorRT headers the plugin library at ``path`` was compiled against
    (its ``dash_trt_plugin_tensorrt_version``), or None where it cannot be read (no such file, a
    library that does not load here, or one built before it carried the symbol). The library
    only works with a TensorRT runtime of that major: it registers nothing in another's."""
    import ctypes

    try:
        lib = ctypes.CDLL(os.fspath(path))
        fn = lib.dash_trt_plugin_tensorrt_version
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int32, []
    value = int(fn())
    return value // 100, value % 100
