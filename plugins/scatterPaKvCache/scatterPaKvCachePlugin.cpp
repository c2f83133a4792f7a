/*
 * ScatterPaKvCache TensorRT plugin (see scatterPaKvCachePlugin.h).
 */
#include "scatterPaKvCachePlugin.h"

#include "pluginCommon.h"

#include <algorithm>
#include <array>
#include <iterator>
#include <limits>

using namespace nvinfer1;

namespace pytrt_kv
{
namespace plugin
{
namespace
{

// The op's input/output positions (kIN_*, kOUT_*) and fields (kFIELD_*), kvContract.h.
using namespace contract::scatterPaKvCache;

// docs/SPEC.md S8 dtypes that TensorRT can hand a plugin: uint8 is not a legal plugin I/O type
// and TensorRT has no FP8 E5M2, so those two stay eager/reference-only.
bool isDataType(DataType t) noexcept
{
    return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16 || t == DataType::kINT8
        || t == DataType::kFP8 || t == DataType::kINT32;
}

bool isRopeType(DataType t) noexcept
{
    return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16;
}

bool isIndexType(DataType t) noexcept
{
    return t == DataType::kINT32 || t == DataType::kINT64;
}

// docs/SPEC.md S9: a float source may be written into an e4m3 or int8 cache with a scale.
bool isQuantPair(DataType source, DataType cache) noexcept
{
    return isRopeType(source) && (cache == DataType::kFP8 || cache == DataType::kINT8);
}

struct CacheGeometry
{
    int64_t numBlocks;
    int64_t blockSize;
};

// Checks one 3-D-key cache against its layout's declared shape (docs/SPEC.md S3-S5), read
// from the layout table of kvContract.h (generated from contract/layouts.py), and returns
// its NB and BS. Dims of -1 (build time) are checked once known.
CacheGeometry checkLayoutCache(
    Dims const& cache, kernels::CacheLayout layout, int64_t heads, int64_t headSize, int32_t itemSize, char const* name)
{
    int32_t const l = static_cast<int32_t>(layout);
    check(l >= 0 && l < contract::kNB_LAYOUTS, name, ": unknown cache layout code ", l);
    checkRank(cache, 4, name);
    char const* const layoutName = contract::kLAYOUT_NAMES[l];
    bool const sized = known(heads) && known(headSize) && heads > 0 && headSize > 0;
    // Elements of one segment: known once H and D are, or always for fixed-byte segments.
    int64_t seg = -1;
    if (sized)
    {
        int64_t const rowBytes = heads * headSize * itemSize;
        int64_t const segBytes = contract::layoutSegmentBytes(l, rowBytes, heads);
        check(rowBytes % segBytes == 0, name, ": layout ", layoutName, " needs H*D*itemsize % ", segBytes,
            " == 0, got H=", heads, " D=", headSize, " itemsize=", itemSize);
        seg = segBytes / itemSize;
    }
    else if (contract::kLAYOUT_SEGMENT[l] == contract::kSEGMENT_BYTES)
    {
        seg = contract::kNZ_SEGMENT_BYTES / itemSize;
    }
    for (int32_t axis = 0; axis < 4; ++axis)
    {
        int32_t const symbol = contract::kLAYOUT_DIMS[l][axis];
        int64_t expected = -1;
        switch (symbol)
        {
        case contract::kDIM_H: expected = heads; break;
        case contract::kDIM_D: expected = headSize; break;
        case contract::kDIM_F: expected = sized ? heads * headSize / seg : -1; break;
        case contract::kDIM_L: expected = seg; break;
        default: continue; // NB and BS: any size
        }
        std::string const what
            = concat(contract::kDIM_NAMES[symbol], ", layout ", layoutName, " ", contract::kLAYOUT_SHAPES[l]);
        checkDim(cache, axis, expected, name, what.c_str());
    }
    return {cache.d[0], cache.d[contract::kLAYOUT_ROW_AXIS[l]]};
}

// The cache_layout field's value as a kernels::CacheLayout (the table's names and codes).
kernels::CacheLayout parseLayout(std::string const& s)
{
    for (int32_t l = 0; l < contract::kNB_LAYOUTS; ++l)
    {
        if (s == contract::kLAYOUT_NAMES[l])
        {
            return static_cast<kernels::CacheLayout>(l);
        }
    }
    std::string names;
    for (int32_t l = 0; l < contract::kNB_LAYOUTS; ++l)
    {
        names += concat(l == 0 ? "" : ", ", "\"", contract::kLAYOUT_NAMES[l], "\"");
    }
    throw PluginError(concat("cache_layout: a 3-D key needs cache_layout one of ", names,
        " (the export helpers resolve it), got \"", s, "\""));
}

} // namespace

std::vector<FieldSpec> const& ScatterPaKvCachePlugin::fieldSpecs()
{
    static std::vector<FieldSpec> const kSPECS{
        {kFIELD_CACHE_LAYOUT, FieldKind::kSTRING, 0, kFIELD_CACHE_LAYOUT_DEFAULT,
            {std::begin(kFIELD_CACHE_LAYOUT_CHOICES), std::end(kFIELD_CACHE_LAYOUT_CHOICES)}, 0, 0},
        {kFIELD_COMPRESS_MODE, FieldKind::kSTRING, 0, kFIELD_COMPRESS_MODE_DEFAULT,
            {std::begin(kFIELD_COMPRESS_MODE_CHOICES), std::end(kFIELD_COMPRESS_MODE_CHOICES)}, 0, 0},
        {ScatterPaKvCachePlugin::kFIELD_ALIAS_IO, FieldKind::kINT, kFIELD_ALIAS_IO_DEFAULT, "", {},
            kFIELD_ALIAS_IO_CHOICES[0], kFIELD_ALIAS_IO_CHOICES[1]},
    };
    return kSPECS;
}

ScatterPaKvCachePlugin::ScatterPaKvCachePlugin(PluginFields fields)
    : PluginBase(std::move(fields))
    , mCacheLayout(mFields.getString(kFIELD_CACHE_LAYOUT))
    , mCompressMode(mFields.getString(kFIELD_COMPRESS_MODE))
{
}

void ScatterPaKvCachePlugin::checkTypes(DataType const* types, int32_t nbInputs) const
{
    (void) kernelTypeOf(types[kIN_KEY], "key");
    bool const scales = nbInputs == kNB_INPUTS_QUANT;
    check(types[kIN_KEY_CACHE] == types[kIN_KEY] || (scales && isQuantPair(types[kIN_KEY], types[kIN_KEY_CACHE])),
        "key_cache: expected the dtype of key (", dataTypeName(types[kIN_KEY]), ")",
        scales ? ", or kFP8/kINT8 with a float key and k_scale" : "", ", got ", dataTypeName(types[kIN_KEY_CACHE]));
    check(
        types[kIN_VALUE_CACHE] == types[kIN_VALUE] || (scales && isQuantPair(types[kIN_VALUE], types[kIN_VALUE_CACHE])),
        "value_cache: expected the dtype of value (", dataTypeName(types[kIN_VALUE]), ")",
        scales ? ", or kFP8/kINT8 with a float value and v_scale" : "", ", got ", dataTypeName(types[kIN_VALUE_CACHE]));
    check(isIndexType(types[kIN_SLOT_MAPPING]), "slot_mapping: expected kINT32 or kINT64, got ",
        dataTypeName(types[kIN_SLOT_MAPPING]));
    for (int32_t i = kIN_K_SCALE; i < nbInputs; ++i)
    {
        check(types[i] == DataType::kFLOAT, kINPUT_NAMES[i], ": expected kFLOAT (docs/SPEC.md S9), got ",
            dataTypeName(types[i]));
    }
    for (int32_t i = kIN_COMPRESS_LENS; i < std::min(nbInputs, kNB_INPUTS_COMPRESS); ++i)
    {
        check(types[i] == types[kIN_SLOT_MAPPING], kINPUT_NAMES[i], ": expected the dtype of slot_mapping (",
            dataTypeName(types[kIN_SLOT_MAPPING]), "), got ", dataTypeName(types[i]));
    }
    check(mCompressMode != "rope" || isRopeType(types[kIN_KEY]),
        "key: compress_mode \"rope\" averages, so it needs kFLOAT, kHALF or kBF16, got ", dataTypeName(types[kIN_KEY]));
}

ScatterPaKvCachePlugin::Shape ScatterPaKvCachePlugin::describe(
    Dims const* dims, DataType const* types, int32_t nbInputs) const
{
    check(validInputCount(nbInputs),
        "inputs: expected 5 (key, value, key_cache, value_cache, slot_mapping), 8 (plus compress_lens, "
        "compress_seq_offsets, seq_lens) or 10 (plus k_scale, v_scale), got ",
        nbInputs);
    Shape shape{};
    kernels::ScatterParams& p = shape.params;
    Dims const& key = dims[kIN_KEY];
    Dims const& value = dims[kIN_VALUE];
    Dims const& keyCache = dims[kIN_KEY_CACHE];
    Dims const& valueCache = dims[kIN_VALUE_CACHE];
    Dims const& slots = dims[kIN_SLOT_MAPPING];
    check(key.nbDims == 3 || key.nbDims == 4, "key: expected [T, H, Dk] or [B, Smax, H, Dk], got ", dimsText(key));

    checkTypes(types, nbInputs);
    p.keyType = kernelTypeOf(types[kIN_KEY], "key");
    p.indexType = kernelTypeOf(types[kIN_SLOT_MAPPING], "slot_mapping");

    // A key-only write passes both value tensors as zero-element placeholders.
    shape.hasValue = !(isEmpty(value) && isEmpty(valueCache));
    bool const hasValue = shape.hasValue;
    p.valueType = hasValue ? kernelTypeOf(types[kIN_VALUE], "value") : p.keyType;
    // docs/SPEC.md S9: scales present (not zero-element placeholders) quantise on write.
    bool const scales = nbInputs == kNB_INPUTS_QUANT;
    shape.hasKScale = scales && !isEmpty(dims[kIN_K_SCALE]);
    shape.hasVScale = scales && hasValue && !isEmpty(dims[kIN_V_SCALE]);
    check(!scales || hasValue || isEmpty(dims[kIN_V_SCALE]),
        "v_scale: a key-only write has no value to quantise; expected a zero-element placeholder, got ",
        dimsText(dims[kIN_V_SCALE]));
    check(shape.hasKScale || types[kIN_KEY_CACHE] == types[kIN_KEY], "key_cache: a ",
        dataTypeName(types[kIN_KEY_CACHE]), " cache for a ", dataTypeName(types[kIN_KEY]),
        " key needs k_scale (docs/SPEC.md S9), got none");
    check(!hasValue || shape.hasVScale || types[kIN_VALUE_CACHE] == types[kIN_VALUE], "value_cache: a ",
        dataTypeName(types[kIN_VALUE_CACHE]), " cache for a ", dataTypeName(types[kIN_VALUE]),
        " value needs v_scale (docs/SPEC.md S9), got none");
    check(!shape.hasKScale || isQuantPair(types[kIN_KEY], types[kIN_KEY_CACHE]),
        "k_scale: quantises a float key into a kFP8 or kINT8 key_cache, got key ", dataTypeName(types[kIN_KEY]),
        " and key_cache ", dataTypeName(types[kIN_KEY_CACHE]));
    check(!shape.hasVScale || isQuantPair(types[kIN_VALUE], types[kIN_VALUE_CACHE]),
        "v_scale: quantises a float value into a kFP8 or kINT8 value_cache, got value ", dataTypeName(types[kIN_VALUE]),
        " and value_cache ", dataTypeName(types[kIN_VALUE_CACHE]));
    if (shape.hasKScale)
    {
        p.keyCacheType = kernelTypeOf(types[kIN_KEY_CACHE], "key_cache");
    }
    if (shape.hasVScale)
    {
        p.valueCacheType = kernelTypeOf(types[kIN_VALUE_CACHE], "value_cache");
    }
    int32_t const keySize = kernels::dataTypeSize(shape.hasKScale ? p.keyCacheType : p.keyType);
    int32_t const valueSize = kernels::dataTypeSize(shape.hasVScale ? p.valueCacheType : p.valueType);

    if (key.nbDims == 3)
    {
        check(mCompressMode.empty(), "compress_mode: applies to a 4-D key only, got \"", mCompressMode, "\" with key ",
            dimsText(key));
        p.compress = false;
        p.layout = parseLayout(mCacheLayout);
        int64_t const tokens = key.d[0];
        int64_t const heads = key.d[1];
        int64_t const headK = key.d[2];
        checkRank(slots, 1, "slot_mapping");
        checkDim(slots, 0, tokens, "slot_mapping", "T of key [T, H, Dk]");
        for (int32_t i = kIN_COMPRESS_LENS; i < std::min(nbInputs, kNB_INPUTS_COMPRESS); ++i)
        {
            check(isEmpty(dims[i]), kINPUT_NAMES[i],
                ": compress tensors apply to a 4-D key; with a 3-D key they may only be zero-element "
                "placeholders, got ",
                dimsText(dims[i]));
        }
        // docs/SPEC.md S9: a scale is [] (per tensor) or [H] (per head).
        auto scaleCount = [&](int32_t i, bool present) -> int32_t {
            if (!present)
            {
                return 0;
            }
            Dims const& d = dims[i];
            check(d.nbDims == 0 || (d.nbDims == 1 && sameOrUnknown(d.d[0], heads)), kINPUT_NAMES[i],
                ": expected [] (per tensor) or [H=", heads, "] (per head), got ", dimsText(d));
            return d.nbDims == 0 ? 1 : (known(heads) ? toInt32(heads, "key dim 1 (H)") : -1);
        };
        p.kScaleCount = scaleCount(kIN_K_SCALE, shape.hasKScale);
        p.vScaleCount = scaleCount(kIN_V_SCALE, shape.hasVScale);
        CacheGeometry const kg = checkLayoutCache(keyCache, p.layout, heads, headK, keySize, "key_cache");
        int64_t headV = 0;
        if (hasValue)
        {
            check(p.layout == kernels::CacheLayout::kNZ || types[kIN_VALUE] == types[kIN_KEY],
                "value: expected the dtype of key (", dataTypeName(types[kIN_KEY]), ") outside layout nz, got ",
                dataTypeName(types[kIN_VALUE]));
            check(p.layout == kernels::CacheLayout::kNZ || types[kIN_VALUE_CACHE] == types[kIN_KEY_CACHE],
                "value_cache: expected the dtype of key_cache (", dataTypeName(types[kIN_KEY_CACHE]),
                ") outside layout nz, got ", dataTypeName(types[kIN_VALUE_CACHE]));
            checkRank(value, 3, "value");
            checkDim(value, 0, tokens, "value", "T of key");
            checkDim(value, 1, heads, "value", "H of key");
            headV = value.d[2];
            CacheGeometry const vg = checkLayoutCache(valueCache, p.layout, heads, headV, valueSize, "value_cache");
            check(sameOrUnknown(vg.numBlocks, kg.numBlocks) && sameOrUnknown(vg.blockSize, kg.blockSize),
                "value_cache: expected NB and BS of key_cache ", dimsText(keyCache), ", got ", dimsText(valueCache));
        }
        p.numTokens = tokens;
        p.numHeads = known(heads) ? toInt32(heads, "key dim 1 (H)") : -1;
        p.headSizeK = known(headK) ? toInt32(headK, "key dim 2 (Dk)") : -1;
        p.headSizeV = known(headV) ? toInt32(headV, "value dim 2 (Dv)") : -1;
        p.numBlocks = kg.numBlocks;
        p.blockSize = known(kg.blockSize) ? toInt32(kg.blockSize, "key_cache block size") : -1;
        return shape;
    }

    // 4-D key: the compressing write, docs/SPEC.md S6.
    check(mCacheLayout.empty(), "cache_layout: applies to a 3-D key only, got \"", mCacheLayout, "\" with key ",
        dimsText(key));
    check(nbInputs >= kNB_INPUTS_COMPRESS,
        "inputs: a 4-D key needs 8 inputs (compress_lens, compress_seq_offsets, seq_lens), got ", nbInputs);
    check(!shape.hasKScale && !shape.hasVScale,
        "k_scale/v_scale: quantise on write applies to a 3-D key only (docs/SPEC.md S9), got scales with key ",
        dimsText(key));
    p.compress = true;
    int64_t const batch = key.d[0];
    int64_t const maxSeq = key.d[1];
    int64_t const heads = key.d[2];
    int64_t const headK = key.d[3];
    checkRank(keyCache, 4, "key_cache");
    checkDim(keyCache, 2, 1, "key_cache", "1, compressing write [NB, BS, 1, Dk]");
    checkDim(keyCache, 3, headK, "key_cache", "Dk of key");
    int64_t headV = 0;
    if (hasValue)
    {
        check(types[kIN_VALUE] == types[kIN_KEY], "value: expected the dtype of key (", dataTypeName(types[kIN_KEY]),
            "), got ", dataTypeName(types[kIN_VALUE]));
        checkRank(value, 4, "value");
        for (int32_t a = 0; a < 3; ++a)
        {
            checkDim(value, a, key.d[a], "value", "B, Smax, H of key");
        }
        headV = value.d[3];
        checkRank(valueCache, 4, "value_cache");
        checkDim(valueCache, 0, keyCache.d[0], "value_cache", "NB of key_cache");
        checkDim(valueCache, 1, keyCache.d[1], "value_cache", "BS of key_cache");
        checkDim(valueCache, 2, 1, "value_cache", "1, compressing write [NB, BS, 1, Dv]");
        checkDim(valueCache, 3, headV, "value_cache", "Dv of value");
    }
    checkRank(slots, 2, "slot_mapping");
    checkDim(slots, 0, batch, "slot_mapping", "B of key, [B, H]");
    checkDim(slots, 1, heads, "slot_mapping", "H of key, [B, H]");
    Dims const& lens = dims[kIN_COMPRESS_LENS];
    checkRank(lens, 2, "compress_lens");
    checkDim(lens, 0, batch, "compress_lens", "B of key, [B, H]");
    checkDim(lens, 1, heads, "compress_lens", "H of key, [B, H]");
    Dims const& seqLens = dims[kIN_SEQ_LENS];
    checkRank(seqLens, 1, "seq_lens");
    checkDim(seqLens, 0, batch, "seq_lens", "B of key");
    Dims const& offsets = dims[kIN_COMPRESS_SEQ_OFFSETS];
    checkRank(offsets, 1, "compress_seq_offsets");
    int64_t const pairs = known(batch) && known(heads) ? batch * heads : -1;
    shape.hasOffsets = !isEmpty(offsets);
    bool const hasOffsets = shape.hasOffsets;
    if (hasOffsets)
    {
        checkDim(offsets, 0, pairs, "compress_seq_offsets", "B*H, or 0 when absent");
    }
    if (mCompressMode.empty())
    {
        p.mode = hasOffsets ? kernels::CompressMode::kROPE : kernels::CompressMode::kALIBI;
    }
    else
    {
        p.mode = mCompressMode == "rope" ? kernels::CompressMode::kROPE
            : mCompressMode == "omni"    ? kernels::CompressMode::kOMNI
                                         : kernels::CompressMode::kALIBI;
        check(p.mode == kernels::CompressMode::kALIBI || hasOffsets || pairs == 0,
            "compress_seq_offsets: ", "compress_mode \"", mCompressMode, "\" needs compress_seq_offsets [B*H], got ",
            dimsText(offsets));
    }
    if (p.mode == kernels::CompressMode::kROPE)
    {
        check(isRopeType(types[kIN_KEY]), "key: compress_mode \"rope\" averages, so it needs kFLOAT, kHALF or kBF16, ",
            "got ", dataTypeName(types[kIN_KEY]));
    }
    p.batch = known(batch) ? toInt32(batch, "key dim 0 (B)") : -1;
    p.maxSeqLen = known(maxSeq) ? toInt32(maxSeq, "key dim 1 (Smax)") : -1;
    p.numHeads = known(heads) ? toInt32(heads, "key dim 2 (H)") : -1;
    p.headSizeK = known(headK) ? toInt32(headK, "key dim 3 (Dk)") : -1;
    p.headSizeV = known(headV) ? toInt32(headV, "value dim 3 (Dv)") : -1;
    p.numBlocks = keyCache.d[0];
    p.blockSize = known(keyCache.d[1]) ? toInt32(keyCache.d[1], "key_cache dim 1 (BS)") : -1;
    return shape;
}

void ScatterPaKvCachePlugin::accept(Dims const* dims, DataType const* types, int32_t nbInputs, bool keep)
{
    Shape const shape = describe(dims, types, nbInputs);
    if (keep)
    {
        mShape = shape;
    }
}

bool ScatterPaKvCachePlugin::supportsType(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs) const noexcept
{
    DataType const t = inOut[pos].desc.type;
    // Decisions for pos use inOut[0..pos] only (TensorRT fills the rest later).
    switch (pos)
    {
    case kIN_KEY: return isDataType(t) && (mCompressMode != "rope" || isRopeType(t));
    case kIN_VALUE: return isDataType(t) && (mCacheLayout == "nz" || t == inOut[kIN_KEY].desc.type);
    // With the scales (10 inputs), a float source may have a kFP8/kINT8 cache (docs/SPEC.md
    // S9); describe() then requires the scale to be present.
    case kIN_KEY_CACHE:
        return t == inOut[kIN_KEY].desc.type
            || (nbInputs == kNB_INPUTS_QUANT && isQuantPair(inOut[kIN_KEY].desc.type, t));
    case kIN_VALUE_CACHE:
        return t == inOut[kIN_VALUE].desc.type
            || (nbInputs == kNB_INPUTS_QUANT && isQuantPair(inOut[kIN_VALUE].desc.type, t));
    case kIN_SLOT_MAPPING: return isIndexType(t);
    default: break;
    }
    if (pos < nbInputs)
    {
        // Inputs 5-7 are index tensors; 8 and 9 (k_scale, v_scale) float32.
        return pos >= kIN_K_SCALE ? t == DataType::kFLOAT : t == inOut[kIN_SLOT_MAPPING].desc.type;
    }
    return t == inOut[pos == nbInputs + kOUT_KEY_CACHE_OUT ? kIN_KEY_CACHE : kIN_VALUE_CACHE].desc.type;
}

cudaError_t ScatterPaKvCachePlugin::launch(
    void const* const* inputs, void* const* outputs, void* /* workspace */, cudaStream_t stream) const
{
    bool const hasValue = mShape.hasValue;

    kernels::ScatterParams p = mShape.params;
    // An empty batch (T == 0, or B*H == 0 for a 4-D key) writes nothing: success
    // without a launch, whatever the kernels make of it (docs/SPEC.md S7).
    if (p.compress ? (p.batch == 0 || p.numHeads == 0) : p.numTokens == 0)
    {
        return cudaSuccess;
    }
    p.key = inputs[kIN_KEY];
    p.value = hasValue ? inputs[kIN_VALUE] : nullptr;
    p.keyCache = outputs[kOUT_KEY_CACHE_OUT];
    p.valueCache = hasValue ? outputs[kOUT_VALUE_CACHE_OUT] : nullptr;
    p.slotMapping = inputs[kIN_SLOT_MAPPING];
    p.kScale = mShape.hasKScale ? inputs[kIN_K_SCALE] : nullptr;
    p.vScale = mShape.hasVScale ? inputs[kIN_V_SCALE] : nullptr;
    if (p.compress)
    {
        p.compressLens = inputs[kIN_COMPRESS_LENS];
        p.compressSeqOffsets = mShape.hasOffsets ? inputs[kIN_COMPRESS_SEQ_OFFSETS] : nullptr;
        p.seqLens = inputs[kIN_SEQ_LENS];
    }
    return kernels::launchScatterPaKvCache(p, stream);
}

} // namespace plugin
} // namespace pytrt_kv
