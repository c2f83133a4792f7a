/*
 * ScatterPaKvCache kernels (docs/SPEC.md section S). No TensorRT types.
 */
#pragma once

#include "kvCommon.h"

#include <cstdint>
#include <cuda_runtime_api.h>

namespace pytrt_kv
{
namespace kernels
{

//! docs/SPEC.md S2: which write a 3-D key performs. A 4-D key always performs S6.
enum class CacheLayout : int32_t
{
    kND = contract::kLAYOUT_ND,   //!< [NB, BS, H, D]
    kNZ = contract::kLAYOUT_NZ,   //!< [NB, H*D/L, BS, L], L = 32 / itemsize
    kHND = contract::kLAYOUT_HND, //!< [NB, H, BS, D]
};

//! docs/SPEC.md S6 compress modes (4-D key).
enum class CompressMode : int32_t
{
    kROPE = contract::kMODE_ROPE,
    kOMNI = contract::kMODE_OMNI,
    kALIBI = contract::kMODE_ALIBI,
};

//! All arguments of one scatter call. Pointers are device (or unified) addresses of
//! dense row-major tensors. Shapes in the comments use docs/SPEC.md's letters.
struct ScatterParams
{
    void const* key{nullptr};                //!< [T, H, Dk] (3-D) | [B, Smax, H, Dk] (4-D)
    void const* value{nullptr};              //!< [T, H, Dv] | [B, Smax, H, Dv]; nullptr: key-only write
    void* keyCache{nullptr};                 //!< layout-dependent, see CacheLayout; [NB, BS, 1, Dk] for 4-D
    void* valueCache{nullptr};               //!< as keyCache with Dv; nullptr exactly when value is
    void const* slotMapping{nullptr};        //!< [T] | [B, H]; negative = padding
    void const* compressLens{nullptr};       //!< [B, H] (4-D only)
    void const* compressSeqOffsets{nullptr}; //!< [B*H] (4-D only); nullptr allowed for alibi
    void const* seqLens{nullptr};            //!< [B] (4-D only)

    DataType keyType{DataType::kFLOAT16};   //!< dtype of key (and of keyCache without kScale)
    DataType valueType{DataType::kFLOAT16}; //!< dtype of value (and of valueCache without vScale)
    DataType indexType{DataType::kINT32};   //!< kINT32 or kINT64, shared by all index tensors

    bool compress{false};                    //!< true: 4-D key, docs/SPEC.md S6
    CacheLayout layout{CacheLayout::kND};    //!< 3-D key only
    CompressMode mode{CompressMode::kALIBI}; //!< 4-D key only

    int64_t numTokens{0}; //!< T (3-D key)
    int32_t batch{0};     //!< B (4-D key)
    int32_t maxSeqLen{0}; //!< Smax (4-D key)
    int32_t numHeads{0};  //!< H
    int32_t headSizeK{0}; //!< Dk
    int32_t headSizeV{0}; //!< Dv
    int64_t numBlocks{0}; //!< NB (same for both caches)
    int32_t blockSize{0}; //!< BS (same for both caches)
    // docs/SPEC.md S9, quantise on write (3-D key only): with kScale set, key (float32,
    // float16 or bfloat16) is written into keyCache as keyCacheType (kFP8_E4M3 or kINT8),
    // q = convert(clamp(float(x) / scale[h], -M, M)); likewise value with vScale.
    void const* kScale{nullptr};                  //!< float32 [kScaleCount]; nullptr: bytes copied
    void const* vScale{nullptr};                  //!< float32 [vScaleCount]; nullptr: bytes copied
    DataType keyCacheType{DataType::kFP8_E4M3};   //!< with kScale: dtype of keyCache
    DataType valueCacheType{DataType::kFP8_E4M3}; //!< with vScale: dtype of valueCache
    int32_t kScaleCount{0};                       //!< with kScale: 1 (per tensor) or numHeads (per head)
    int32_t vScaleCount{0};                       //!< with vScale: 1 or numHeads
};

//! Enqueue one scatter call on \p stream: a single launch, no host synchronization, no
//! allocation (capturable in a CUDA graph). Never writes outside the caches: negative
//! slots and rows >= NB*BS are skipped. Returns cudaErrorInvalidValue for parameters
//! that break docs/SPEC.md's shape/dtype rules (checked on the host, before any launch), else
//! the launch status. T == 0 or B == 0 launches nothing and returns cudaSuccess.
//!
//! Details: duplicated slots give an unspecified winner. An S6 run with values docs/SPEC.md
//! forbids (L > Smax, w < 0, or a compressed head with o < 0 or o + w > L) writes nothing
//! (scatterRows.h); rows of a run past NB*BS are skipped one by one. Copies use the
//! widest of 16/8/4/2/1-byte vectors that every address and row size allows. Why a call
//! was refused: lastErrorMessage() (kvError.h).
cudaError_t launchScatterPaKvCache(ScatterParams const& params, cudaStream_t stream);

} // namespace kernels
} // namespace pytrt_kv
