/*
 * The creators this library offers, shared by both entry points: getCreators()
 * (registration.cpp) and load-time registration (autoRegister.cpp).
 */
#pragma once

#include "NvInferRuntime.h"

#include <cstdint>

namespace pytrt_kv
{
namespace plugin
{

//! The library's creators (static lifetime); \p nbCreators receives their count.
nvinfer1::IPluginCreatorInterface* const* allCreators(int32_t& nbCreators) noexcept;

} // namespace plugin
} // namespace pytrt_kv
