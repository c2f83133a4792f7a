/*
 * ScatterPaKvCache (docs/SPEC.md S3-S7). One launch per call; groups of G threads move one
 * cache row (a token's bytes for one tensor) with W-byte vector accesses, W the widest
 * width that every address and row size allows.
 */
#include "scatterPaKvCache.h"

#include "kvDispatch.cuh"
#include "kvError.h"
#include "kvLaunch.h"
#include "kvQuant.h"
#include "scatterRows.h"

#include <algorithm>
#include <cstring>

namespace pytrt_kv
{
namespace kernels
{
namespace
{

//! docs/SPEC.md S3-S5 for one tensor: a token row of the source is nseg segments of segBytes;
//! segment seg of the token in slot (blk, off) goes to byte
//! ((blk*nseg + seg)*BS + off)*segBytes of the cache, which is nd (nseg = 1), hnd
//! (nseg = H) and nz (32-byte segments, nseg = H*D*itemsize/32) alike.
struct TokenRows
{
    char const* src{nullptr};
    char* dst{nullptr};
    int64_t segBytes{0};
    int32_t nseg{0};
    Divider vectorsPerSegment{1, 0}; //!< segBytes / W (set at launch)
};

//! docs/SPEC.md S6 for one tensor: [B, Smax, H, D] into [NB, BS, 1, D].
struct RunRows
{
    char const* src{nullptr};
    char* dst{nullptr};
    int64_t rowBytes{0};
    int32_t headSize{0};
};

template <typename IndexT>
struct TokenArgs
{
    IndexT const* slots;
    TokenRows rows[2];
    int32_t numTensors;
    int64_t numTokens;
    int64_t cacheRows; // NB * BS
    Divider blockSize;
    int32_t group;
};

template <typename IndexT>
struct RunArgs
{
    IndexT const* slots;   // [B*H]
    IndexT const* lens;    // [B*H]
    IndexT const* offsets; // [B*H] or nullptr
    IndexT const* seqLens; // [B]
    RunRows rows[2];
    int32_t numTensors;
    int32_t batch;
    int32_t heads;
    int32_t maxSeqLen;
    int64_t cacheRows;
    CompressMode mode;
    int32_t group;
};

template <typename IndexT, int W>
__global__ void __launch_bounds__(kBLOCK_THREADS) scatterTokensKernel(TokenArgs<IndexT> const a)
{
    int32_t const groupsPerBlock = kBLOCK_THREADS / a.group;
    int32_t const lane = threadIdx.x % a.group;
    int64_t const stride = static_cast<int64_t>(gridDim.x) * groupsPerBlock;
    int32_t const tensorShift = a.numTensors - 1; // numTensors is 1 or 2
    int64_t const tasks = a.numTokens << tensorShift;
    for (int64_t task = static_cast<int64_t>(blockIdx.x) * groupsPerBlock + threadIdx.x / a.group; task < tasks;
        task += stride)
    {
        int64_t const t = task >> tensorShift;
        TokenRows const& r = (task & tensorShift) == 0 ? a.rows[0] : a.rows[1];
        // The slot load is issued first; copyVectors issues the source loads (always in
        // bounds: key[t]) before the slot is tested in ready(), so both latencies overlap.
        IndexT const rawSlot = loadGlobal(a.slots + t);
        char const* src = r.src + t * (r.nseg * r.segBytes);
        char* dstBase = nullptr;
        auto ready = [&]() {
            int64_t const slot = static_cast<int64_t>(rawSlot);
            if (slot < 0 || slot >= a.cacheRows)
            {
                return false; // padding, or a row outside the cache: never written
            }
            int64_t const blk = a.blockSize.div(slot);
            int64_t const off = slot - blk * a.blockSize.divisor;
            dstBase = r.dst + (blk * r.nseg * a.blockSize.divisor + off) * r.segBytes;
            return true;
        };
        auto source = [&](int32_t idx) { return src + static_cast<int64_t>(idx) * W; };
        if (r.nseg == 1)
        {
            // nd (and any single-segment row): the destination row is contiguous.
            copyVectors<W, LoadPolicy::kREADONLY>(
                static_cast<int32_t>(r.segBytes / W), lane, a.group, source,
                [&](int32_t idx) { return dstBase + static_cast<int64_t>(idx) * W; }, ready);
        }
        else
        {
            // hnd/nz: segment seg of the row is segStride bytes after the previous one;
            // vectors per segment is a power of two for every usual head size (a shift).
            int64_t const segStride = a.blockSize.divisor * r.segBytes;
            Divider const vps = r.vectorsPerSegment;
            copyVectors<W, LoadPolicy::kREADONLY>(
                static_cast<int32_t>(r.nseg * vps.divisor), lane, a.group, source,
                [&](int32_t idx) {
                    int32_t const seg = vps.div32(idx);
                    int32_t const within = idx - seg * static_cast<int32_t>(vps.divisor);
                    return dstBase + seg * segStride + static_cast<int64_t>(within) * W;
                },
                ready);
        }
    }
}

//! docs/SPEC.md S9 for one tensor: the geometry of TokenRows in cache bytes (1-byte
//! elements), a float source read N elements (one chunk) at a time, and the scale.
struct QuantRows
{
    char const* src{nullptr};
    char* dst{nullptr};
    int64_t segBytes{0}; //!< cache bytes (= elements) per segment: H*D (nd), D (hnd), 32 (nz)
    int32_t nseg{0};
    Divider chunksPerSegment{1, 0}; //!< segBytes / N
    float const* scale{nullptr};
    bool perHead{false};
    Divider chunksPerHead{1, 0}; //!< D / N: chunk c of a token row belongs to head c / (D / N)
};

template <typename IndexT>
struct QuantArgs
{
    IndexT const* slots;
    QuantRows rows[2];
    int32_t numTensors;
    int64_t numTokens;
    int64_t cacheRows;
    Divider blockSize;
    int32_t group;
};

//! docs/SPEC.md S9: as scatterTokensKernel, but each lane loads N source elements (one
//! vector of N * sizeof(SrcT) bytes), converts them with Q and stores N cache bytes: the
//! conversion rides the same vector path, no extra pass over the tokens.
template <typename IndexT, typename SrcT, typename Q, int N>
__global__ void __launch_bounds__(kBLOCK_THREADS) scatterQuantTokensKernel(QuantArgs<IndexT> const a)
{
    constexpr int kSRC_BYTES = N * static_cast<int>(sizeof(SrcT));
    using SrcV = typename VecOf<kSRC_BYTES>::Type;
    using DstV = typename VecOf<N>::Type;
    int32_t const groupsPerBlock = kBLOCK_THREADS / a.group;
    int32_t const lane = threadIdx.x % a.group;
    int64_t const stride = static_cast<int64_t>(gridDim.x) * groupsPerBlock;
    int32_t const tensorShift = a.numTensors - 1;
    int64_t const tasks = a.numTokens << tensorShift;
    for (int64_t task = static_cast<int64_t>(blockIdx.x) * groupsPerBlock + threadIdx.x / a.group; task < tasks;
        task += stride)
    {
        int64_t const t = task >> tensorShift;
        QuantRows const& r = (task & tensorShift) == 0 ? a.rows[0] : a.rows[1];
        IndexT const rawSlot = loadGlobal(a.slots + t);
        Divider const cps = r.chunksPerSegment;
        int32_t const nChunks = r.nseg * static_cast<int32_t>(cps.divisor);
        char const* src = r.src + t * nChunks * static_cast<int64_t>(kSRC_BYTES);
        float const tensorScale = r.perHead ? 1.0F : __ldg(r.scale);
        int64_t const segStride = a.blockSize.divisor * r.segBytes;
        char* dstBase = nullptr;
        bool first = true;
        for (int32_t base = lane; base < nChunks; base += a.group * kUNROLL)
        {
            SrcV buf[kUNROLL];
#pragma unroll
            for (int u = 0; u < kUNROLL; ++u)
            {
                int32_t const idx = base + u * a.group;
                if (idx < nChunks)
                {
                    buf[u] = __ldg(reinterpret_cast<SrcV const*>(src + static_cast<int64_t>(idx) * kSRC_BYTES));
                }
            }
            if (first)
            {
                first = false;
                int64_t const slot = static_cast<int64_t>(rawSlot);
                if (slot < 0 || slot >= a.cacheRows)
                {
                    break; // padding, or a row outside the cache: never written
                }
                int64_t const blk = a.blockSize.div(slot);
                int64_t const off = slot - blk * a.blockSize.divisor;
                dstBase = r.dst + (blk * r.nseg * a.blockSize.divisor + off) * r.segBytes;
            }
#pragma unroll
            for (int u = 0; u < kUNROLL; ++u)
            {
                int32_t const idx = base + u * a.group;
                if (idx < nChunks)
                {
                    float const scale = r.perHead ? __ldg(r.scale + r.chunksPerHead.div32(idx)) : tensorScale;
                    SrcT e[N];
                    memcpy(e, &buf[u], kSRC_BYTES);
                    unsigned char q[N];
#pragma unroll
                    for (int j = 0; j < N; ++j)
                    {
                        q[j] = quantise<Q>(FloatIO<SrcT>::toFloat(e[j]), scale);
                    }
                    DstV out;
                    memcpy(&out, q, N);
                    int32_t const seg = r.nseg == 1 ? 0 : cps.div32(idx);
                    int32_t const within = idx - seg * static_cast<int32_t>(cps.divisor);
                    __stwb(reinterpret_cast<DstV*>(dstBase + seg * segStride + static_cast<int64_t>(within) * N), out);
                }
            }
        }
    }
}

//! Non-"rope" instantiations carry no float type.
struct NoMean
{
};

template <typename IndexT, int W, typename MeanT>
__global__ void __launch_bounds__(kBLOCK_THREADS) scatterRunsKernel(RunArgs<IndexT> const a)
{
    int32_t const groupsPerBlock = kBLOCK_THREADS / a.group;
    int32_t const lane = threadIdx.x % a.group;
    int64_t const stride = static_cast<int64_t>(gridDim.x) * groupsPerBlock;
    int64_t const tasks = static_cast<int64_t>(a.batch) * a.heads * a.maxSeqLen * a.numTensors;
    for (int64_t task = static_cast<int64_t>(blockIdx.x) * groupsPerBlock + threadIdx.x / a.group; task < tasks;
        task += stride)
    {
        RunRows const r = (task % a.numTensors) == 0 ? a.rows[0] : a.rows[1];
        int64_t const rest = task / a.numTensors;
        int32_t const i = static_cast<int32_t>(rest % a.maxSeqLen);
        int64_t const bh = rest / a.maxSeqLen;
        int64_t const b = bh / a.heads;
        int64_t const h = bh - b * a.heads;
        int64_t const base = static_cast<int64_t>(loadGlobal(a.slots + bh));
        if (base < 0)
        {
            continue; // padding run
        }
        int64_t const offset = a.offsets != nullptr ? static_cast<int64_t>(loadGlobal(a.offsets + bh)) : int64_t{-1};
        CompressRun const run = compressRun(a.mode, static_cast<int64_t>(loadGlobal(a.seqLens + b)),
            static_cast<int64_t>(loadGlobal(a.lens + bh)), offset, a.maxSeqLen);
        int32_t const source = compressRowSource(a.mode, run, i);
        // base may be any non-negative index value: test before adding so that nothing
        // wraps around.
        if (source == kROW_NONE || base >= a.cacheRows - i)
        {
            continue;
        }
        int64_t const row = base + i;
        char* dst = r.dst + row * r.rowBytes;
        // Token x_t of this head: key[b, t, h, :].
        auto tokenRow = [&](int64_t t) { return r.src + ((b * a.maxSeqLen + t) * a.heads + h) * r.rowBytes; };
        if (source == kROW_MEAN)
        {
            if constexpr (!std::is_same<MeanT, NoMean>::value)
            {
                // float32 sum in token order, divided by float32(w), rounded to nearest even.
                for (int32_t e = lane; e < r.headSize; e += a.group)
                {
                    float acc = 0.0F;
                    for (int32_t t = run.offset; t < run.offset + run.width; ++t)
                    {
                        acc += FloatIO<MeanT>::toFloat(loadGlobal(reinterpret_cast<MeanT const*>(tokenRow(t)) + e));
                    }
                    storeGlobal(reinterpret_cast<MeanT*>(dst) + e,
                        FloatIO<MeanT>::fromFloat(asGpuResult(acc / static_cast<float>(run.width))));
                }
            }
            continue;
        }
        char const* src = tokenRow(source);
        copyVectors<W, LoadPolicy::kREADONLY>(
            static_cast<int32_t>(r.rowBytes / W), lane, a.group,
            [&](int32_t idx) { return src + static_cast<int64_t>(idx) * W; },
            [&](int32_t idx) { return dst + static_cast<int64_t>(idx) * W; }, AlwaysReady{});
    }
}

bool isByteMoverType(DataType t)
{
    int32_t const size = dataTypeSize(t);
    return size == 1 || size == 2 || size == 4;
}

bool isFloatType(DataType t)
{
    return t == DataType::kFLOAT32 || t == DataType::kFLOAT16 || t == DataType::kBFLOAT16;
}

bool isQuantCacheType(DataType t)
{
    return t == DataType::kFP8_E4M3 || t == DataType::kINT8;
}

bool misalignedTo(void const* ptr, int32_t bytes)
{
    return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) != 0;
}

//! Element size of the key (\p key) or value cache: the source's, or the quantised type's.
int32_t cacheItemSize(ScatterParams const& p, bool key)
{
    if (key)
    {
        return dataTypeSize(p.kScale != nullptr ? p.keyCacheType : p.keyType);
    }
    return dataTypeSize(p.vScale != nullptr ? p.valueCacheType : p.valueType);
}

//! docs/SPEC.md S9 rules the kernels can check (the scales' values are trusted).
cudaError_t checkQuantise(ScatterParams const& p, bool empty)
{
    if (p.kScale == nullptr && p.vScale == nullptr)
    {
        return cudaSuccess;
    }
    if (p.compress)
    {
        return invalidArgument("scatter: kScale/vScale apply to a 3-D key only (docs/SPEC.md S9)");
    }
    if (p.vScale != nullptr && p.value == nullptr && !empty)
    {
        return invalidArgument("scatter: vScale needs value and valueCache");
    }
    struct One
    {
        void const* scale;
        void const* src;
        DataType srcType;
        DataType cacheType;
        int32_t count;
    };
    for (One const& t : {One{p.kScale, p.key, p.keyType, p.keyCacheType, p.kScaleCount},
             One{p.vScale, p.value, p.valueType, p.valueCacheType, p.vScaleCount}})
    {
        if (t.scale == nullptr)
        {
            continue;
        }
        if (!isFloatType(t.srcType) || !isQuantCacheType(t.cacheType))
        {
            return invalidArgument(
                "scatter: quantise on write needs a float32, float16 or bfloat16 source and a kFP8_E4M3 or "
                "kINT8 cache");
        }
        if (t.count != 1 && t.count != p.numHeads)
        {
            return invalidArgument("scatter: kScaleCount/vScaleCount must be 1 (per tensor) or numHeads (per head)");
        }
        if (misalignedTo(t.scale, 4) || (!empty && t.src != nullptr && misalignedTo(t.src, dataTypeSize(t.srcType))))
        {
            return invalidArgument("scatter: quantise on write needs scales and sources aligned to their itemsize");
        }
    }
    return cudaSuccess;
}

//! True when a call with these sizes writes nothing. Its tensors may then have no elements,
//! and TensorRT passes null for zero-volume tensors, so no pointer is required.
bool writesNothing(ScatterParams const& p)
{
    return p.numBlocks == 0 || (p.compress ? p.batch == 0 || p.maxSeqLen == 0 : p.numTokens == 0);
}

cudaError_t checkScatter(ScatterParams const& p)
{
    bool const empty = writesNothing(p);
    if (!empty && (p.key == nullptr || p.keyCache == nullptr || p.slotMapping == nullptr))
    {
        return invalidArgument("scatter: key, keyCache and slotMapping must not be null");
    }
    if (!empty && (p.value == nullptr) != (p.valueCache == nullptr))
    {
        return invalidArgument("scatter: value and valueCache must be both given or both null");
    }
    if (p.indexType != DataType::kINT32 && p.indexType != DataType::kINT64)
    {
        return invalidArgument("scatter: indexType must be kINT32 or kINT64");
    }
    bool const hasValue = p.value != nullptr || p.valueCache != nullptr;
    if (!isByteMoverType(p.keyType) || (hasValue && !isByteMoverType(p.valueType)))
    {
        return invalidArgument("scatter: keyType/valueType must be a 1-, 2- or 4-byte type");
    }
    if (p.numHeads <= 0 || p.headSizeK <= 0 || (hasValue && p.headSizeV <= 0) || p.blockSize <= 0 || p.numBlocks < 0)
    {
        return invalidArgument(
            "scatter: numHeads, headSizeK, headSizeV (with value) and blockSize must be > 0, "
            "numBlocks >= 0");
    }
    // The kernels count a row's vectors in int32 (W >= 1 byte each): a token row of one
    // tensor (H * D * itemsize bytes; D * itemsize for the compressing write) fits in int32.
    if (static_cast<int64_t>(p.numHeads) * p.headSizeK * dataTypeSize(p.keyType) > INT32_MAX
        || (hasValue && static_cast<int64_t>(p.numHeads) * p.headSizeV * dataTypeSize(p.valueType) > INT32_MAX))
    {
        return invalidArgument("scatter: numHeads * headSize * itemsize must fit in int32 for key and value");
    }
    if (!p.compress)
    {
        if (p.numTokens < 0)
        {
            return invalidArgument("scatter: numTokens must be >= 0");
        }
        int32_t const layout = static_cast<int32_t>(p.layout);
        if (layout < 0 || layout >= contract::kNB_LAYOUTS)
        {
            return invalidArgument("scatter: layout must be a code of kvContract.h's layout table (kND, kNZ, kHND)");
        }
        // The layout table's segments must cut a token whole: H*D*itemsize a multiple of
        // the segment's bytes (only nz's 32-byte segments can fail).
        auto const whole = [&](int32_t headSize, bool key) {
            int64_t const rowBytes = static_cast<int64_t>(p.numHeads) * headSize * cacheItemSize(p, key);
            return rowBytes % contract::layoutSegmentBytes(layout, rowBytes, p.numHeads) == 0; // all > 0 here
        };
        if (!whole(p.headSizeK, true) || (hasValue && !whole(p.headSizeV, false)))
        {
            return invalidArgument(
                "scatter: the layout needs H*D*itemsize to be a multiple of its segment bytes "
                "(nz: H*D*itemsize % 32 == 0) for key and value");
        }
        return checkQuantise(p, empty);
    }
    if (p.batch < 0 || p.maxSeqLen < 0)
    {
        return invalidArgument("scatter: batch and maxSeqLen must be >= 0");
    }
    if (p.kScale != nullptr || p.vScale != nullptr)
    {
        return checkQuantise(p, empty);
    }
    if (p.mode != CompressMode::kROPE && p.mode != CompressMode::kOMNI && p.mode != CompressMode::kALIBI)
    {
        return invalidArgument("scatter: mode must be kROPE, kOMNI or kALIBI");
    }
    if (!empty
        && (p.compressLens == nullptr || p.seqLens == nullptr
            || (p.mode != CompressMode::kALIBI && p.compressSeqOffsets == nullptr)))
    {
        return invalidArgument(
            "scatter: compressLens and seqLens (and compressSeqOffsets for rope/omni) must "
            "not be null");
    }
    if (p.mode == CompressMode::kROPE && (!isFloatType(p.keyType) || (hasValue && p.valueType != p.keyType)))
    {
        return invalidArgument(
            "scatter: rope compression needs float32, float16 or bfloat16 key and the same "
            "value dtype");
    }
    // The mean row is read and written one element at a time: every tensor must be aligned
    // to its element size (always true for framework tensors; raw pointers may not be).
    if (p.mode == CompressMode::kROPE && !empty)
    {
        auto const misaligned = [&](void const* ptr) {
            return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(dataTypeSize(p.keyType)) != 0;
        };
        if (misaligned(p.key) || misaligned(p.keyCache) || misaligned(p.value) || misaligned(p.valueCache))
        {
            return invalidArgument("scatter: rope compression needs key, value and caches aligned to the itemsize");
        }
    }
    return cudaSuccess;
}

// A key-only write (numTensors == 1) mirrors the key's rows into the value slot, so the
// kernels may read either. Returns the vector width that suits both slots' source and
// destination addresses and their bytes per copy (the \p bytes member).
template <typename Rows>
int mirrorRowsAndVectorWidth(Rows (&rows)[2], int32_t numTensors, int64_t Rows::* bytes)
{
    if (numTensors == 1)
    {
        rows[1] = rows[0];
    }
    return vectorWidth({reinterpret_cast<uint64_t>(rows[0].src), reinterpret_cast<uint64_t>(rows[0].dst),
        static_cast<uint64_t>(rows[0].*bytes), reinterpret_cast<uint64_t>(rows[1].src),
        reinterpret_cast<uint64_t>(rows[1].dst), static_cast<uint64_t>(rows[1].*bytes)});
}

template <typename IndexT>
cudaError_t launchTokens(ScatterParams const& p, cudaStream_t stream)
{
    TokenArgs<IndexT> a{};
    a.slots = static_cast<IndexT const*>(p.slotMapping);
    a.numTensors = p.value != nullptr ? 2 : 1;
    a.numTokens = p.numTokens;
    a.cacheRows = p.numBlocks * p.blockSize;
    a.blockSize = Divider::make(p.blockSize);
    int64_t maxVectorsBytes = 0;
    for (int32_t k = 0; k < a.numTensors; ++k)
    {
        int64_t const itemBytes = dataTypeSize(k == 0 ? p.keyType : p.valueType);
        int64_t const rowBytes = p.numHeads * itemBytes * (k == 0 ? p.headSizeK : p.headSizeV);
        TokenRows& r = a.rows[k];
        r.src = static_cast<char const*>(k == 0 ? p.key : p.value);
        r.dst = static_cast<char*>(k == 0 ? p.keyCache : p.valueCache);
        // The segment rule of the layout table (contract/layouts.py via kvContract.h).
        r.segBytes = contract::layoutSegmentBytes(static_cast<int32_t>(p.layout), rowBytes, p.numHeads);
        r.nseg = static_cast<int32_t>(rowBytes / r.segBytes);
        maxVectorsBytes = std::max(maxVectorsBytes, rowBytes);
    }
    int const width = mirrorRowsAndVectorWidth(a.rows, a.numTensors, &TokenRows::segBytes);
    for (TokenRows& r : a.rows)
    {
        r.vectorsPerSegment = Divider::make(r.segBytes / width);
    }
    a.group = groupSize(maxVectorsBytes / width);
    return dispatchVectorWidth(width, [&](auto w) {
        constexpr auto kernel = scatterTokensKernel<IndexT, decltype(w)::value>;
        int64_t const grid = residentGridSize<kernel>(a.numTokens * a.numTensors, a.group);
        PYTRT_KV_LAUNCH("scatterTokensKernel", kernel, static_cast<unsigned>(grid), kBLOCK_THREADS, stream, a);
        return recordLaunch(cudaGetLastError(), "scatterTokensKernel");
    });
}

//! docs/SPEC.md S9: one launch converting key (and value, when \p numTensors is 2, with
//! the same source and cache types) into its quantised cache.
template <typename IndexT>
cudaError_t launchQuantTokens(ScatterParams const& p, int32_t numTensors, cudaStream_t stream)
{
    QuantArgs<IndexT> a{};
    a.slots = static_cast<IndexT const*>(p.slotMapping);
    a.numTensors = numTensors;
    a.numTokens = p.numTokens;
    a.cacheRows = p.numBlocks * p.blockSize;
    a.blockSize = Divider::make(p.blockSize);
    int32_t const srcSize = dataTypeSize(p.keyType);
    int32_t const chunkMax = 16 / srcSize; // 16-byte source vectors
    uint64_t dstAlign = 16;
    uint64_t srcAlign = 16;
    for (int32_t k = 0; k < numTensors; ++k)
    {
        int64_t const headSize = k == 0 ? p.headSizeK : p.headSizeV;
        int64_t const rowElems = p.numHeads * headSize;
        QuantRows& r = a.rows[k];
        r.src = static_cast<char const*>(k == 0 ? p.key : p.value);
        r.dst = static_cast<char*>(k == 0 ? p.keyCache : p.valueCache);
        r.scale = static_cast<float const*>(k == 0 ? p.kScale : p.vScale);
        r.perHead = (k == 0 ? p.kScaleCount : p.vScaleCount) > 1;
        // The quantised caches are 1-byte types: segment bytes = elements (kvContract.h).
        r.segBytes = contract::layoutSegmentBytes(static_cast<int32_t>(p.layout), rowElems, p.numHeads);
        r.nseg = static_cast<int32_t>(rowElems / r.segBytes);
        dstAlign
            = static_cast<uint64_t>(vectorWidth({static_cast<uint64_t>(dstAlign), reinterpret_cast<uint64_t>(r.dst),
                static_cast<uint64_t>(r.segBytes), static_cast<uint64_t>(r.perHead ? headSize : 16)}));
        srcAlign = static_cast<uint64_t>(vectorWidth({srcAlign, reinterpret_cast<uint64_t>(r.src)}));
    }
    // N elements a chunk: the widest the addresses, segments (and heads, per-head scales)
    // allow, else one element at a time.
    int64_t const fit = std::min<int64_t>(static_cast<int64_t>(dstAlign), static_cast<int64_t>(srcAlign) / srcSize);
    int32_t const chunk = fit >= chunkMax ? chunkMax : 1;
    int64_t maxChunks = 0;
    for (int32_t k = 0; k < numTensors; ++k)
    {
        QuantRows& r = a.rows[k];
        int64_t const headSize = k == 0 ? p.headSizeK : p.headSizeV;
        r.chunksPerSegment = Divider::make(r.segBytes / chunk);
        r.chunksPerHead = Divider::make(r.perHead ? headSize / chunk : 1);
        maxChunks = std::max<int64_t>(maxChunks, p.numHeads * headSize / chunk);
    }
    if (numTensors == 1)
    {
        a.rows[1] = a.rows[0];
    }
    a.group = groupSize(maxChunks);
    auto launch = [&](auto srcTag, auto quantTag, auto n) {
        using SrcT = typename decltype(srcTag)::Type;
        using Q = typename decltype(quantTag)::Type;
        constexpr auto kernel = scatterQuantTokensKernel<IndexT, SrcT, Q, decltype(n)::value>;
        int64_t const grid = residentGridSize<kernel>(a.numTokens * a.numTensors, a.group);
        PYTRT_KV_LAUNCH("scatterQuantTokensKernel", kernel, static_cast<unsigned>(grid), kBLOCK_THREADS, stream, a);
        return recordLaunch(cudaGetLastError(), "scatterQuantTokensKernel");
    };
    return dispatchFloatType(p.keyType, [&](auto srcTag) {
        using SrcT = typename decltype(srcTag)::Type;
        constexpr int kCHUNK = 16 / static_cast<int>(sizeof(SrcT));
        auto withQuant = [&](auto quantTag) {
            return chunk == kCHUNK ? launch(srcTag, quantTag, std::integral_constant<int, kCHUNK>{})
                                   : launch(srcTag, quantTag, std::integral_constant<int, 1>{});
        };
        return p.keyCacheType == DataType::kINT8 ? withQuant(TypeTag<QuantInt8>{}) : withQuant(TypeTag<QuantE4m3>{});
    });
}

//! A 3-D key: one launch for both tensors when they are written alike (both copied, or
//! both quantised from one source type into one cache type), else one launch per tensor.
template <typename IndexT>
cudaError_t launchTokenWrites(ScatterParams const& p, cudaStream_t stream)
{
    bool const hasValue = p.value != nullptr;
    bool const quantKey = p.kScale != nullptr;
    bool const quantValue = hasValue && p.vScale != nullptr;
    if (!quantKey && !quantValue)
    {
        return launchTokens<IndexT>(p, stream);
    }
    if (hasValue && quantKey && quantValue && p.keyType == p.valueType && p.keyCacheType == p.valueCacheType)
    {
        return launchQuantTokens<IndexT>(p, 2, stream);
    }
    ScatterParams keyOnly = p;
    keyOnly.value = nullptr;
    keyOnly.valueCache = nullptr;
    keyOnly.vScale = nullptr;
    cudaError_t const st
        = quantKey ? launchQuantTokens<IndexT>(keyOnly, 1, stream) : launchTokens<IndexT>(keyOnly, stream);
    if (st != cudaSuccess || !hasValue)
    {
        return st;
    }
    ScatterParams valueOnly = keyOnly;
    valueOnly.key = p.value;
    valueOnly.keyCache = p.valueCache;
    valueOnly.keyType = p.valueType;
    valueOnly.keyCacheType = p.valueCacheType;
    valueOnly.headSizeK = p.headSizeV;
    valueOnly.kScale = p.vScale;
    valueOnly.kScaleCount = p.vScaleCount;
    return quantValue ? launchQuantTokens<IndexT>(valueOnly, 1, stream) : launchTokens<IndexT>(valueOnly, stream);
}

template <typename IndexT>
cudaError_t launchRuns(ScatterParams const& p, cudaStream_t stream)
{
    RunArgs<IndexT> a{};
    a.slots = static_cast<IndexT const*>(p.slotMapping);
    a.lens = static_cast<IndexT const*>(p.compressLens);
    a.offsets = static_cast<IndexT const*>(p.compressSeqOffsets);
    a.seqLens = static_cast<IndexT const*>(p.seqLens);
    a.numTensors = p.value != nullptr ? 2 : 1;
    a.batch = p.batch;
    a.heads = p.numHeads;
    a.maxSeqLen = p.maxSeqLen;
    a.cacheRows = p.numBlocks * p.blockSize;
    a.mode = p.mode;
    if (a.mode == CompressMode::kALIBI)
    {
        a.offsets = nullptr; // alibi never reads the offsets
    }
    int64_t maxRowBytes = 0;
    for (int32_t k = 0; k < a.numTensors; ++k)
    {
        RunRows& r = a.rows[k];
        r.headSize = k == 0 ? p.headSizeK : p.headSizeV;
        r.rowBytes = static_cast<int64_t>(r.headSize) * dataTypeSize(k == 0 ? p.keyType : p.valueType);
        r.src = static_cast<char const*>(k == 0 ? p.key : p.value);
        r.dst = static_cast<char*>(k == 0 ? p.keyCache : p.valueCache);
        maxRowBytes = std::max(maxRowBytes, r.rowBytes);
    }
    int const width = mirrorRowsAndVectorWidth(a.rows, a.numTensors, &RunRows::rowBytes);
    a.group = groupSize(maxRowBytes / width);
    int64_t const tasks = static_cast<int64_t>(a.batch) * a.heads * a.maxSeqLen * a.numTensors;
    auto launch = [&](auto w, auto meanTag) {
        using MeanT = typename decltype(meanTag)::Type;
        constexpr auto kernel = scatterRunsKernel<IndexT, decltype(w)::value, MeanT>;
        int64_t const grid = residentGridSize<kernel>(tasks, a.group);
        PYTRT_KV_LAUNCH("scatterRunsKernel", kernel, static_cast<unsigned>(grid), kBLOCK_THREADS, stream, a);
        return recordLaunch(cudaGetLastError(), "scatterRunsKernel");
    };
    return dispatchVectorWidth(width, [&](auto w) {
        if (p.mode == CompressMode::kROPE)
        {
            return dispatchFloatType(p.keyType, [&](auto meanTag) { return launch(w, meanTag); });
        }
        return launch(w, TypeTag<NoMean>{});
    });
}

} // namespace

cudaError_t launchScatterPaKvCache(ScatterParams const& params, cudaStream_t stream)
{
    clearLastError();
    cudaError_t const status = checkScatter(params);
    if (status != cudaSuccess)
    {
        return status;
    }
    if (writesNothing(params))
    {
        return cudaSuccess; // nothing can be written
    }
    cudaError_t const pending = refusePendingError("scatter");
    if (pending != cudaSuccess)
    {
        return pending;
    }
    return dispatchIndexType(params.indexType, [&](auto indexTag) {
        using IndexT = typename decltype(indexTag)::Type;
        return params.compress ? launchRuns<IndexT>(params, stream) : launchTokenWrites<IndexT>(params, stream);
    });
}

} // namespace kernels
} // namespace pytrt_kv
