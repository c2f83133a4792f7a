/*
 * pytrt_kv kernels: types shared by both operators. CUDA runtime headers only; no
 * TensorRT types (the plugins adapt TensorRT descriptors to these).
 */
#pragma once

#include <cstdint>

namespace pytrt_kv
{
namespace kernels
{

//! Element types the kernels know. Byte movers only care about the size; the "rope"
//! compressing write needs the float format to average.
enum class DataType : int32_t
{
    kFLOAT32 = 0,
    kFLOAT16 = 1,
    kBFLOAT16 = 2,
    kINT8 = 3,
    kUINT8 = 4,
    kFP8_E4M3 = 5,
    kFP8_E5M2 = 6,
    kINT32 = 7,
    kINT64 = 8,
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
