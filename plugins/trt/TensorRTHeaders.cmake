# Finds TensorRT's public C++ headers; never the TensorRT libraries (the plugin does not link
# libnvinfer). Looks in, in order:
#   1. TensorRT_ROOT / TENSORRT_ROOT (CMake variables or environment variables): <root>/include
#      or <root> itself;
#   2. the compiler's and the system's include paths (e.g. /usr/include/x86_64-linux-gnu from
#      the Debian packages, /usr/local/TensorRT/include);
#   3. an `include` folder inside the `tensorrt` Python wheel's packages, when present.
# Sets TensorRT_INCLUDE_DIR and TensorRT_VERSION (major.minor.patch, from NvInferVersion.h; TRT 11
# spells the numbers through TRT_*_ENTERPRISE macros) and fails if the version is below
# DASH_TRT_MIN_VERSION.

set(TensorRT_ROOT "" CACHE PATH "TensorRT folder holding include/NvInfer.h (or the headers themselves)")
set(TENSORRT_ROOT "" CACHE PATH "Alias of TensorRT_ROOT")

set(_dash_trt_roots)
foreach(_root IN ITEMS "${TensorRT_ROOT}" "${TENSORRT_ROOT}" "$ENV{TensorRT_ROOT}" "$ENV{TENSORRT_ROOT}")
  if(NOT _root STREQUAL "")
    get_filename_component(_root "${_root}" ABSOLUTE BASE_DIR "${CMAKE_SOURCE_DIR}")
    list(APPEND _dash_trt_roots "${_root}")
  endif()
endforeach()

# A different root than last time: search again instead of keeping the cached folder.
if(NOT "${_dash_trt_roots}" STREQUAL "${_DASH_TRT_ROOTS_USED}")
  unset(TensorRT_INCLUDE_DIR CACHE)
  set(_DASH_TRT_ROOTS_USED "${_dash_trt_roots}" CACHE INTERNAL "roots of the last TensorRT header search")
endif()

if(_dash_trt_roots)
  find_path(TensorRT_INCLUDE_DIR NvInferVersion.h PATHS ${_dash_trt_roots} PATH_SUFFIXES include
            NO_DEFAULT_PATH DOC "TensorRT headers")
  if(NOT TensorRT_INCLUDE_DIR)
    message(FATAL_ERROR "DASH_BUILD_TRT_PLUGIN: no TensorRT headers (NvInferVersion.h) under "
                        "${_dash_trt_roots} or their include/ folders.")
  endif()
else()
  set(_dash_trt_wheel_dirs)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
              "import importlib.util as u, os; [print(os.path.join(d, 'include')) for m in ('tensorrt', 'tensorrt_libs', 'tensorrt_bindings') for s in [u.find_spec(m)] if s and s.submodule_search_locations for d in s.submodule_search_locations]"
      OUTPUT_VARIABLE _dash_trt_wheel_out ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    string(REPLACE "\n" ";" _dash_trt_wheel_dirs "${_dash_trt_wheel_out}")
  endif()
  find_path(TensorRT_INCLUDE_DIR NvInferVersion.h
            PATHS /usr/include/x86_64-linux-gnu /usr/include/aarch64-linux-gnu /usr/local/TensorRT/include
                  /opt/tensorrt/include ${_dash_trt_wheel_dirs}
            DOC "TensorRT headers")
endif()

if(NOT TensorRT_INCLUDE_DIR OR NOT EXISTS "${TensorRT_INCLUDE_DIR}/NvInferRuntime.h")
  message(FATAL_ERROR
    "DASH_BUILD_TRT_PLUGIN is ON but the TensorRT headers (NvInferVersion.h, NvInferRuntime.h) were not found. "
    "Point TensorRT_ROOT (or the TENSORRT_ROOT environment variable) at a TensorRT release or header folder, "
    "e.g. -DTensorRT_ROOT=/usr/local/TensorRT, or configure with -DDASH_BUILD_TRT_PLUGIN=OFF. "
    "Only the headers are needed to build the plugin.")
endif()

function(_dash_trt_version_part content name out)
  string(REGEX MATCH "#define[ \t]+${name}[ \t]+([A-Za-z0-9_]+)" _m "${content}")
  set(_v "${CMAKE_MATCH_1}")
  if(NOT _v STREQUAL "" AND NOT _v MATCHES "^[0-9]+$")
    # TensorRT 11: #define NV_TENSORRT_MAJOR TRT_MAJOR_ENTERPRISE, then #define TRT_MAJOR_ENTERPRISE 11
    string(REGEX MATCH "#define[ \t]+${_v}[ \t]+([0-9]+)" _m "${content}")
    set(_v "${CMAKE_MATCH_1}")
  endif()
  set(${out} "${_v}" PARENT_SCOPE)
endfunction()

file(READ "${TensorRT_INCLUDE_DIR}/NvInferVersion.h" _dash_trt_version_h)
_dash_trt_version_part("${_dash_trt_version_h}" NV_TENSORRT_MAJOR _major)
_dash_trt_version_part("${_dash_trt_version_h}" NV_TENSORRT_MINOR _minor)
_dash_trt_version_part("${_dash_trt_version_h}" NV_TENSORRT_PATCH _patch)
if(_major STREQUAL "" OR _minor STREQUAL "")
  message(FATAL_ERROR "Could not read the TensorRT version from ${TensorRT_INCLUDE_DIR}/NvInferVersion.h")
endif()
if(_patch STREQUAL "")
  set(_patch 0)
endif()
set(TensorRT_VERSION "${_major}.${_minor}.${_patch}")
if(TensorRT_VERSION VERSION_LESS DASH_TRT_MIN_VERSION)
  message(FATAL_ERROR "TensorRT ${TensorRT_VERSION} headers in ${TensorRT_INCLUDE_DIR}: the DashAttention plugin "
                      "needs TensorRT >= ${DASH_TRT_MIN_VERSION} (IPluginV3OneBuildV2 aliasing, plugins preferred "
                      "over ONNX local functions).")
endif()
message(STATUS "TensorRT ${TensorRT_VERSION} headers: ${TensorRT_INCLUDE_DIR} (headers only; libnvinfer is not linked)")
