/*
 * pytrt_kv kernels: types shared by both operators. CUDA runtime headers only; no
 * TensorRT types (the plugins adapt TensorRT descriptors to these).
 */
#pragma once

#include "kvContract.h"

#include <cstdint>

namespace pytrt_kv
{
namespace kernels
{

//! Element types the kernels know (values: kvContract.h, pytrt_kv/contract/limits.py). Byte movers only care about the
//! size; the "rope" compressing write needs the float format to average.
enum class DataType : int32_t
{
    kFLOAT32 = contract::kDTYPE_FLOAT32,
    kFLOAT16 = contract::kDTYPE_FLOAT16,
    kBFLOAT16 = contract::kDTYPE_BFLOAT16,
    kINT8 = contract::kDTYPE_INT8,
    kUINT8 = contract::kDTYPE_UINT8,
    kFP8_E4M3 = contract::kDTYPE_FLOAT8_E4M3FN,
    kFP8_E5M2 = contract::kDTYPE_FLOAT8_E5M2,
    kINT32 = contract::kDTYPE_INT32,
    kINT64 = contract::kDTYPE_INT64,
};

//! Size in bytes of one element of \p t (0 for an unknown value).
inline constexpr int32_t dataTypeSize(DataType t)
{
    switch (t)
    {
    case DataType::kFLOAT32:
    case DataType::kINT32: return 4;
    case DataType::kFLOAT16:
    case DataType::kBFLOAT16: return 2;
    case DataType::kINT8:
    case DataType::kUINT8:
    case DataType::kFP8_E4M3:
    case DataType::kFP8_E5M2: return 1;
    case DataType::kINT64: return 8;
    }
    return 0;
}

} // namespace kernels
} // namespace pytrt_kv
