# FindTensorRT: TensorRT *headers* (the plugins need no TensorRT library to build).
#
# Inputs, as CMake variables or environment variables of the same name (a CMake
# variable wins):
#   TensorRT_INCLUDE_DIR  folder holding NvInfer.h and NvInferVersion.h (the include/
#                         folder of a TensorRT release or of the TensorRT OSS repository)
#   TensorRT_ROOT         a TensorRT install; its include/ folder is searched
# Outputs:
#   TensorRT_FOUND, TensorRT_INCLUDE_DIRS, TensorRT_VERSION (from NvInferVersion.h),
#   TensorRT_VERSION_MAJOR/MINOR/PATCH, and the imported target TensorRT::Headers;
#   TensorRT_NOT_FOUND_REASON (why not, when not found) and TensorRT_REQUESTED (TRUE when
#   TensorRT_INCLUDE_DIR or TensorRT_ROOT was given: then a failure is the caller's error,
#   which CMakeLists.txt reports as fatal instead of building without plugins).
# TensorRT 10.3 or newer is required (IPluginV3OneBuildV2, aliased plugin I/O).

set(_trt_min_version 10.3)

foreach(_v TensorRT_INCLUDE_DIR TensorRT_ROOT)
  if(NOT ${_v} AND DEFINED ENV{${_v}} AND NOT "$ENV{${_v}}" STREQUAL "")
    set(${_v} "$ENV{${_v}}")
  endif()
endforeach()

set(TensorRT_REQUESTED FALSE)
if(TensorRT_INCLUDE_DIR OR TensorRT_ROOT)
  set(TensorRT_REQUESTED TRUE)
endif()

set(_trt_hints)
if(TensorRT_INCLUDE_DIR)
  list(APPEND _trt_hints "${TensorRT_INCLUDE_DIR}")
endif()
if(TensorRT_ROOT)
  list(APPEND _trt_hints "${TensorRT_ROOT}/include")
endif()

set(_trt_why "")
if(TensorRT_INCLUDE_DIR AND NOT EXISTS "${TensorRT_INCLUDE_DIR}/NvInferVersion.h")
  # A variable that names the wrong folder is an error to report, not a reason to go
  # searching elsewhere.
  set(_trt_why "TensorRT_INCLUDE_DIR=${TensorRT_INCLUDE_DIR} has no NvInferVersion.h")
  set(TensorRT_INCLUDE_DIR "TensorRT_INCLUDE_DIR-NOTFOUND")
else()
  find_path(TensorRT_INCLUDE_DIR
    NAMES NvInferVersion.h
    HINTS ${_trt_hints}
    PATHS /usr/include/x86_64-linux-gnu /usr/include/aarch64-linux-gnu /usr/local/TensorRT/include
    DOC "Folder holding NvInfer.h (set TensorRT_INCLUDE_DIR or TensorRT_ROOT)")
endif()

if(TensorRT_INCLUDE_DIR AND EXISTS "${TensorRT_INCLUDE_DIR}/NvInferVersion.h")
  file(READ "${TensorRT_INCLUDE_DIR}/NvInferVersion.h" _trt_version_h)
  foreach(_part MAJOR MINOR PATCH)
    # TensorRT 10 defines NV_TENSORRT_<PART> as a number; 11 defines it through
    # TRT_<PART>_ENTERPRISE.
    if(_trt_version_h MATCHES "#define[ \t]+NV_TENSORRT_${_part}[ \t]+([0-9]+)")
      set(TensorRT_VERSION_${_part} "${CMAKE_MATCH_1}")
    elseif(_trt_version_h MATCHES "#define[ \t]+TRT_${_part}_ENTERPRISE[ \t]+([0-9]+)")
      set(TensorRT_VERSION_${_part} "${CMAKE_MATCH_1}")
    else()
      set(TensorRT_VERSION_${_part} "")
    endif()
  endforeach()
  if(TensorRT_VERSION_MAJOR STREQUAL "" OR TensorRT_VERSION_MINOR STREQUAL "")
    set(_trt_why "cannot read the version from ${TensorRT_INCLUDE_DIR}/NvInferVersion.h")
    set(TensorRT_VERSION "")
  else()
    set(TensorRT_VERSION "${TensorRT_VERSION_MAJOR}.${TensorRT_VERSION_MINOR}.${TensorRT_VERSION_PATCH}")
    if(TensorRT_VERSION VERSION_LESS _trt_min_version)
      set(_trt_why "TensorRT ${TensorRT_VERSION} headers in ${TensorRT_INCLUDE_DIR}, but pytrt_kv needs ${_trt_min_version} or newer")
    elseif(NOT EXISTS "${TensorRT_INCLUDE_DIR}/NvInferRuntime.h")
      set(_trt_why "${TensorRT_INCLUDE_DIR} has NvInferVersion.h but no NvInferRuntime.h")
    endif()
  endif()
elseif(_trt_why STREQUAL "" AND TensorRT_ROOT)
  set(_trt_why "TensorRT_ROOT=${TensorRT_ROOT} has no include/NvInferVersion.h")
elseif(_trt_why STREQUAL "")
  set(_trt_why "TensorRT headers not found")
endif()

if(NOT _trt_why STREQUAL "")
  set(_trt_ok FALSE)
else()
  set(_trt_ok TRUE)
  if(TensorRT_ROOT)
    # TensorRT_ROOT given but the headers came from elsewhere: not what was asked for.
    string(FIND "${TensorRT_INCLUDE_DIR}" "${TensorRT_ROOT}" _trt_pos)
    if(NOT _trt_pos EQUAL 0)
      set(_trt_ok FALSE)
      set(_trt_why "TensorRT_ROOT=${TensorRT_ROOT} has no include/NvInferVersion.h")
    endif()
  endif()
endif()
set(TensorRT_NOT_FOUND_REASON "${_trt_why}")

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(TensorRT
  REQUIRED_VARS TensorRT_INCLUDE_DIR _trt_ok
  VERSION_VAR TensorRT_VERSION
  REASON_FAILURE_MESSAGE
    "${_trt_why}. Set TensorRT_INCLUDE_DIR to the folder holding NvInfer.h (CMake -D or environment variable), or TensorRT_ROOT to a TensorRT install.")

if(TensorRT_FOUND)
  set(TensorRT_INCLUDE_DIRS "${TensorRT_INCLUDE_DIR}")
  if(NOT TARGET TensorRT::Headers)
    add_library(TensorRT::Headers INTERFACE IMPORTED)
    # SYSTEM: TensorRT's own headers must not trip this project's -Wall -Wextra.
    set_target_properties(TensorRT::Headers PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${TensorRT_INCLUDE_DIR}"
      INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${TensorRT_INCLUDE_DIR}")
  endif()
else()
  set(TensorRT_INCLUDE_DIRS "")
  set(TensorRT_VERSION "")
endif()
mark_as_advanced(TensorRT_INCLUDE_DIR)
unset(_trt_hints)
unset(_trt_ok)
