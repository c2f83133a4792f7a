# Layer 3: the TensorRT IPluginV3 plugins, included by plugins/CMakeLists.txt once
# TensorRT headers were found (cmake/FindTensorRT.cmake). No TensorRT *library* is
# linked: everything here builds from headers alone.
#
#  - pytrt_kv_plugin_objects   the plugin code, compiled once
#  - libpytrt_kv_plugins.so    exports getCreators + setLoggerFinder only (loadLibrary,
#                              trtexec --dynamicPlugins); --no-undefined proves it needs
#                              nothing from libnvinfer
#  - libpytrt_kv_plugins_autoreg.so  the same objects plus autoRegister.cpp, which finds
#                              getPluginRegistry() with dlsym at load time (polygraphy
#                              --plugins, ctypes.CDLL, trtexec --staticPlugins)
#  - pytrt_kv_plugin_harness   drives the plugins through their creators without
#                              libnvinfer (CPU checks; enqueue on a GPU)

set(_pytrt_kv_plugin_warn $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)

add_library(pytrt_kv_plugin_objects OBJECT
  common/pluginCommon.cpp
  common/pluginFields.cpp
  scatterPaKvCache/scatterPaKvCachePlugin.cpp
  gatherSelectionKvCache/gatherSelectionKvCachePlugin.cpp
  registration.cpp)
set_target_properties(pytrt_kv_plugin_objects PROPERTIES POSITION_INDEPENDENT_CODE ON)
set(_pytrt_kv_plugin_includes
  "${CMAKE_CURRENT_SOURCE_DIR}/common"
  "${CMAKE_CURRENT_SOURCE_DIR}/kernels"
  "${CMAKE_CURRENT_SOURCE_DIR}/scatterPaKvCache"
  "${CMAKE_CURRENT_SOURCE_DIR}/gatherSelectionKvCache")
target_include_directories(pytrt_kv_plugin_objects PRIVATE ${_pytrt_kv_plugin_includes})
target_link_libraries(pytrt_kv_plugin_objects PRIVATE TensorRT::Headers CUDA::cudart_static)
target_compile_options(pytrt_kv_plugin_objects PRIVATE ${_pytrt_kv_plugin_warn})

# The objects are added as sources (not linked as a target, which would add them twice);
# the kernels' object library is linked, which adds its objects once.

# Export maps: only the entry points leave the libraries (hidden visibility is the
# project default; the maps also hide what static cudart brings along).
set(_pytrt_kv_plugins_map "${CMAKE_CURRENT_BINARY_DIR}/pytrtKvPlugins.map")
file(WRITE "${_pytrt_kv_plugins_map}"
  "{\n  global:\n    getCreators;\n    setLoggerFinder;\n  local:\n    *;\n};\n")
set(_pytrt_kv_autoreg_map "${CMAKE_CURRENT_BINARY_DIR}/pytrtKvPluginsAutoreg.map")
file(WRITE "${_pytrt_kv_autoreg_map}"
  "{\n  global:\n    pytrt_kv_registered_creators;\n  local:\n    *;\n};\n")

add_library(pytrt_kv_plugins SHARED $<TARGET_OBJECTS:pytrt_kv_plugin_objects>)
target_link_libraries(pytrt_kv_plugins PRIVATE pytrt_kv_kernels_impl CUDA::cudart_static ${CMAKE_DL_LIBS})
set_target_properties(pytrt_kv_plugins PROPERTIES
  OUTPUT_NAME pytrt_kv_plugins
  LINK_DEPENDS "${_pytrt_kv_plugins_map}")
target_link_options(pytrt_kv_plugins PRIVATE
  "LINKER:--version-script=${_pytrt_kv_plugins_map}"
  "LINKER:--no-undefined")

add_library(pytrt_kv_plugins_autoreg SHARED autoRegister.cpp $<TARGET_OBJECTS:pytrt_kv_plugin_objects>)
target_include_directories(pytrt_kv_plugins_autoreg PRIVATE ${_pytrt_kv_plugin_includes})
target_link_libraries(pytrt_kv_plugins_autoreg PRIVATE
  TensorRT::Headers pytrt_kv_kernels_impl CUDA::cudart_static ${CMAKE_DL_LIBS})
target_compile_options(pytrt_kv_plugins_autoreg PRIVATE ${_pytrt_kv_plugin_warn})
set_target_properties(pytrt_kv_plugins_autoreg PROPERTIES
  OUTPUT_NAME pytrt_kv_plugins_autoreg
  LINK_DEPENDS "${_pytrt_kv_autoreg_map}")
target_link_options(pytrt_kv_plugins_autoreg PRIVATE
  "LINKER:--version-script=${_pytrt_kv_autoreg_map}"
  "LINKER:--no-undefined")

install(TARGETS pytrt_kv_plugins pytrt_kv_plugins_autoreg
  LIBRARY DESTINATION "${PYTRT_KV_INSTALL_LIBDIR}")

# Not installed: a developer/CI tool (scripts/gpu_check.sh, tests/test_plugins_*.py).
# scripts/build_wheel.sh turns it off (-DPYTRT_KV_BUILD_HARNESS=OFF): a third of the
# compile steps for nothing the wheel carries.
option(PYTRT_KV_BUILD_HARNESS "Build pytrt_kv_plugin_harness (not installed)" ON)
if(NOT PYTRT_KV_BUILD_HARNESS)
  return()
endif()
add_executable(pytrt_kv_plugin_harness
  harness/pluginHarness.cpp
  harness/mockTrt.cpp
  harness/pluginDriver.cpp
  harness/harnessCheck.cpp
  harness/shapeCases.cpp
  harness/cpuChecks.cpp
  harness/gpuRunner.cpp
  harness/harnessIo.cpp
  $<TARGET_OBJECTS:pytrt_kv_plugin_objects>)
target_include_directories(pytrt_kv_plugin_harness PRIVATE ${_pytrt_kv_plugin_includes})
target_link_libraries(pytrt_kv_plugin_harness PRIVATE TensorRT::Headers pytrt_kv_kernels_impl CUDA::cudart_static
  ${CMAKE_DL_LIBS})
target_compile_options(pytrt_kv_plugin_harness PRIVATE ${_pytrt_kv_plugin_warn})
target_link_options(pytrt_kv_plugin_harness PRIVATE "LINKER:--no-undefined")
