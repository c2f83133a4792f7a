/*
 * GatherSelectionKvCache TensorRT plugin (see gatherSelectionKvCachePlugin.h).
 */
#include "gatherSelectionKvCachePlugin.h"

#include "pluginCommon.h"

#include <array>
#include <limits>

using namespace nvinfer1;

namespace pytrt_kv
{
namespace plugin
{
namespace
{

// The op's input/output positions (kIN_*, kOUT_*) and fields (kFIELD_*), kvContract.h.
using namespace contract::gatherSelectionKvCache;

using Self = GatherSelectionKvCachePlugin;

// docs/SPEC.md G2 cache dtypes that TensorRT can express (it has no FP8 E5M2).
bool isCacheType(DataType t) noexcept
{
    return t == DataType::kHALF || t == DataType::kBF16 || t == DataType::kINT8 || t == DataType::kFLOAT
        || t == DataType::kFP8;
}

bool isCacheInput(int32_t pos) noexcept
{
    return pos == kIN_SELECTION_K_ROPE || pos == kIN_SELECTION_KV_CACHE || pos == kIN_FULL_K_ROPE
        || pos == kIN_FULL_KV_CACHE;
}

// -1 stays "unknown" (build time); a known size must fit the kernels' int32 fields.
int32_t narrow(int64_t v, char const* name)
{
    return known(v) ? toInt32(v, name) : -1;
}

} // namespace

std::vector<FieldSpec> const& GatherSelectionKvCachePlugin::fieldSpecs()
{
    static std::vector<FieldSpec> const kSPECS{
        {kFIELD_SELECTION_TOPK_BLOCK_SIZE, FieldKind::kINT, kFIELD_SELECTION_TOPK_BLOCK_SIZE_DEFAULT, "", {}, 1,
            std::numeric_limits<int32_t>::max()},
        {Self::kFIELD_ALIAS_IO, FieldKind::kINT, kFIELD_ALIAS_IO_DEFAULT, "", {}, kFIELD_ALIAS_IO_CHOICES[0],
            kFIELD_ALIAS_IO_CHOICES[1]},
    };
    return kSPECS;
}

GatherSelectionKvCachePlugin::GatherSelectionKvCachePlugin(PluginFields fields)
    : PluginBase(std::move(fields))
    , mTopkBlockSize(static_cast<int32_t>(mFields.getInt(kFIELD_SELECTION_TOPK_BLOCK_SIZE)))
{
}

void GatherSelectionKvCachePlugin::checkTypes(DataType const* types, int32_t /* nbInputs */) const
{
    DataType const cacheType = types[kIN_SELECTION_KV_CACHE];
    check(isCacheType(cacheType), "selection_kv_cache: expected kHALF, kBF16, kINT8, kFLOAT or kFP8, got ",
        dataTypeName(cacheType));
    for (int32_t i = 0; i < kNB_INPUTS; ++i)
    {
        if (isCacheInput(i))
        {
            check(types[i] == cacheType, kINPUT_NAMES[i], ": expected the dtype of selection_kv_cache (",
                dataTypeName(cacheType), "), got ", dataTypeName(types[i]));
        }
        else
        {
            check(types[i] == DataType::kINT32, kINPUT_NAMES[i], ": expected kINT32, got ", dataTypeName(types[i]));
        }
    }
}

kernels::GatherSelectionParams GatherSelectionKvCachePlugin::describe(Dims const* dims, DataType const* types) const
{
    checkTypes(types, kNB_INPUTS);

    Dims const& kv = dims[kIN_SELECTION_KV_CACHE];
    Dims const& fullKv = dims[kIN_FULL_KV_CACHE];
    checkRank(kv, 3, "selection_kv_cache");
    checkRank(fullKv, 3, "full_kv_cache");
    checkDim(fullKv, 2, kv.d[2], "full_kv_cache", "KV of selection_kv_cache");
    int64_t const selBlockNum = kv.d[0];
    int64_t const selBlockSize = kv.d[1];
    int64_t const fullBlockNum = fullKv.d[0];
    int64_t const fullBlockSize = fullKv.d[1];

    // The k_rope pair, as _gather.py check_gather decides it: present when both are
    // [*, *, K_ROPE] with the same K_ROPE >= 1 (even with zero blocks), and then shaped
    // like their caches; otherwise both must be zero-element: the quantised ("C8") mode,
    // where only kv rows move.
    Dims const& rope = dims[kIN_SELECTION_K_ROPE];
    Dims const& fullRope = dims[kIN_FULL_K_ROPE];
    bool const ropeEmpty = isEmpty(rope);
    bool const bothShaped = rope.nbDims == 3 && fullRope.nbDims == 3 && !(known(rope.d[2]) && rope.d[2] < 1)
        && sameOrUnknown(rope.d[2], fullRope.d[2]);
    check(bothShaped || ropeEmpty == isEmpty(fullRope),
        "selection_k_rope, full_k_rope: expected both present or both zero-element, got ", dimsText(rope), " and ",
        dimsText(fullRope));
    bool const hasRope = bothShaped || !ropeEmpty;
    int64_t ropeDim = 0;
    if (hasRope)
    {
        checkRank(rope, 3, "selection_k_rope");
        checkRank(fullRope, 3, "full_k_rope");
        checkDim(rope, 0, selBlockNum, "selection_k_rope", "S_BLOCK_NUM of selection_kv_cache");
        checkDim(rope, 1, selBlockSize, "selection_k_rope", "SBS of selection_kv_cache");
        checkDim(fullRope, 0, fullBlockNum, "full_k_rope", "F_BLOCK_NUM of full_kv_cache");
        checkDim(fullRope, 1, fullBlockSize, "full_k_rope", "FBS of full_kv_cache");
        checkDim(fullRope, 2, rope.d[2], "full_k_rope", "K_ROPE of selection_k_rope");
        ropeDim = rope.d[2];
    }

    Dims const& table = dims[kIN_SELECTION_KV_BLOCK_TABLE];
    checkRank(table, 2, "selection_kv_block_table");
    Dims const& fullTable = dims[kIN_FULL_KV_BLOCK_TABLE];
    checkRank(fullTable, 2, "full_kv_block_table");
    int64_t const batch = fullTable.d[0];
    Dims const& kvSeq = dims[kIN_FULL_KV_ACTUAL_SEQ];
    checkRank(kvSeq, 1, "full_kv_actual_seq");
    checkDim(kvSeq, 0, batch, "full_kv_actual_seq", "B of full_kv_block_table");
    Dims const& qSeq = dims[kIN_FULL_Q_ACTUAL_SEQ];
    checkRank(qSeq, 1, "full_q_actual_seq");
    checkDim(qSeq, 0, batch, "full_q_actual_seq", "B of full_kv_block_table");

    Dims const& status = dims[kIN_SELECTION_KV_BLOCK_STATUS];
    Dims const& topk = dims[kIN_SELECTION_TOPK_INDICES];
    check(status.nbDims == 4 || status.nbDims == 3,
        "selection_kv_block_status: expected BSND [B, S, H, K+1] or TND [B*S, H, K+1], got ", dimsText(status));
    checkRank(topk, status.nbDims, "selection_topk_indices");
    int64_t seq{-1};
    int64_t heads{-1};
    int64_t const k = topk.d[topk.nbDims - 1];
    if (status.nbDims == 4)
    {
        checkDim(status, 0, batch, "selection_kv_block_status", "B of full_kv_block_table, BSND [B, S, H, K+1]");
        seq = status.d[1];
        heads = status.d[2];
        for (int32_t a = 0; a < 3; ++a)
        {
            checkDim(topk, a, status.d[a], "selection_topk_indices", "B, S, H of selection_kv_block_status");
        }
    }
    else
    {
        int64_t const tokens = status.d[0];
        heads = status.d[1];
        checkDim(topk, 0, tokens, "selection_topk_indices", "T of selection_kv_block_status");
        checkDim(topk, 1, heads, "selection_topk_indices", "H of selection_kv_block_status");
        if (known(tokens) && known(batch))
        {
            check(batch > 0 ? tokens % batch == 0 : tokens == 0,
                "selection_kv_block_status: TND needs T % B == 0, got T=", tokens, " B=", batch);
            seq = batch > 0 ? tokens / batch : 0;
        }
    }
    checkDim(status, status.nbDims - 1, known(k) ? k + 1 : -1, "selection_kv_block_status",
        "K+1, K = last dim of selection_topk_indices");
    check(sameOrUnknown(heads, 1), "selection_kv_block_status: expected H == 1, got ", dimsText(status));

    int64_t const tbs = mTopkBlockSize;
    if (known(selBlockSize))
    {
        check(selBlockSize > 0 && selBlockSize % tbs == 0, "selection_kv_cache: block size SBS=", selBlockSize,
            " must be a positive multiple of selection_topk_block_size=", tbs);
    }
    if (known(fullBlockSize))
    {
        check(fullBlockSize > 0 && fullBlockSize % tbs == 0, "full_kv_cache: block size FBS=", fullBlockSize,
            " must be a positive multiple of selection_topk_block_size=", tbs);
    }
    if (known(k))
    {
        check(k <= kMAX_TOPK, "selection_topk_indices: expected K <= ", kMAX_TOPK, ", got ", k);
    }
    if (known(table.d[0]) && known(batch) && known(seq))
    {
        check(table.d[0] >= batch * seq, "selection_kv_block_table: expected R >= B*S*H = ", batch * seq, ", got ",
            dimsText(table));
    }
    if (known(table.d[1]) && known(k) && known(selBlockSize) && selBlockSize > 0)
    {
        int64_t const need = (k * tbs + selBlockSize - 1) / selBlockSize;
        check(table.d[1] >= need, "selection_kv_block_table: expected S_MAX_BLOCK_NUM >= ceil(K*TBS/SBS) = ", need,
            ", got ", dimsText(table));
    }

    kernels::GatherSelectionParams p{};
    p.cacheType = kernelTypeOf(types[kIN_SELECTION_KV_CACHE], "selection_kv_cache");
    p.batch = narrow(batch, "B");
    p.seqPerBatch = narrow(seq, "S");
    p.topk = narrow(k, "K");
    p.topkBlockSize = mTopkBlockSize;
    p.selectionRows = narrow(table.d[0], "R");
    p.selectionBlockNum = selBlockNum;
    p.selectionBlockSize = narrow(selBlockSize, "SBS");
    p.selectionMaxBlockNum = narrow(table.d[1], "S_MAX_BLOCK_NUM");
    p.fullBlockNum = fullBlockNum;
    p.fullBlockSize = narrow(fullBlockSize, "FBS");
    p.fullMaxBlockNum = narrow(fullTable.d[1], "F_MAX_BLOCK_NUM");
    p.kRopeDim = narrow(ropeDim, "K_ROPE");
    p.kvDim = narrow(kv.d[2], "KV");
    return p;
}

void GatherSelectionKvCachePlugin::accept(Dims const* dims, DataType const* types, int32_t /* nbInputs */, bool keep)
{
    kernels::GatherSelectionParams const p = describe(dims, types);
    if (keep)
    {
        mParams = p;
    }
}

bool GatherSelectionKvCachePlugin::supportsType(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs) const noexcept
{
    DataType const t = inOut[pos].desc.type;
    if (pos == kIN_SELECTION_K_ROPE)
    {
        return isCacheType(t);
    }
    // Decisions for pos use inOut[0..pos] only: every cache tensor follows input 0.
    int32_t const outIndex = pos - nbInputs;
    bool const cache = pos < nbInputs
        ? isCacheInput(pos)
        : (outIndex == kOUT_SELECTION_K_ROPE_OUT || outIndex == kOUT_SELECTION_KV_CACHE_OUT);
    return cache ? t == inOut[kIN_SELECTION_K_ROPE].desc.type : t == DataType::kINT32;
}

void GatherSelectionKvCachePlugin::otherOutputTypes(DataType* outputTypes) const
{
    outputTypes[kOUT_SELECTION_KV_ACTUAL_SEQ] = DataType::kINT32;
}

void GatherSelectionKvCachePlugin::otherOutputShapes(DimsExprs const* inputs, DimsExprs* outputs) const
{
    // selection_kv_actual_seq is [R], R = dim 0 of selection_kv_block_table.
    check(inputs[kIN_SELECTION_KV_BLOCK_TABLE].nbDims == 2, "selection_kv_block_table: expected rank 2, got ",
        inputs[kIN_SELECTION_KV_BLOCK_TABLE].nbDims);
    outputs[kOUT_SELECTION_KV_ACTUAL_SEQ].nbDims = 1;
    outputs[kOUT_SELECTION_KV_ACTUAL_SEQ].d[0] = inputs[kIN_SELECTION_KV_BLOCK_TABLE].d[0];
}

size_t GatherSelectionKvCachePlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    DynamicPluginTensorDesc const* /* outputs */, int32_t /* nbOutputs */) const noexcept
{
    try
    {
        check(inputs != nullptr && nbInputs == kNB_INPUTS, "getWorkspaceSize: expected 10 inputs, got ", nbInputs);
        // The kernels need one int32 per plan entry, B*S*K = the volume of
        // selection_topk_indices (BSND [B, S, 1, K] and TND [B*S, 1, K] alike): its
        // profile maximum bounds every run-time shape.
        Dims const& topkMax = inputs[kIN_SELECTION_TOPK_INDICES].max;
        int64_t const entries = volume(topkMax);
        check(entries >= 0, "selection_topk_indices: expected known profile maxima, got ", dimsText(topkMax));
        return kernels::getGatherPlanWorkspaceSize(entries);
    }
    catch (std::exception const& e)
    {
        logException("GatherSelectionKvCache::getWorkspaceSize", e);
    }
    return 0;
}

cudaError_t GatherSelectionKvCachePlugin::launch(
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) const
{
    kernels::GatherSelectionParams p = mParams;
    // An empty batch (B*S == 0) gathers nothing: the caches and the status keep their
    // contents, every selection_kv_actual_seq row is 0 (rows past B*S always are),
    // and no kernel is launched (docs/SPEC.md G3).
    if (static_cast<int64_t>(p.batch) * p.seqPerBatch == 0)
    {
        size_t const bytes = static_cast<size_t>(p.selectionRows) * sizeof(int32_t);
        cudaError_t const st
            = bytes == 0 ? cudaSuccess : cudaMemsetAsync(outputs[kOUT_SELECTION_KV_ACTUAL_SEQ], 0, bytes, stream);
        if (st != cudaSuccess)
        {
            cudaGetLastError(); // ours: never left pending for the next launch (as copyIfDistinct)
        }
        check(st == cudaSuccess, "enqueue: clearing selection_kv_actual_seq failed: ", cudaGetErrorName(st));
        return cudaSuccess;
    }
    p.selectionKRope = p.kRopeDim > 0 ? outputs[kOUT_SELECTION_K_ROPE_OUT] : nullptr;
    p.selectionKvCache = outputs[kOUT_SELECTION_KV_CACHE_OUT];
    p.selectionKvBlockTable = static_cast<int32_t const*>(inputs[kIN_SELECTION_KV_BLOCK_TABLE]);
    p.selectionKvBlockStatus = static_cast<int32_t*>(outputs[kOUT_SELECTION_KV_BLOCK_STATUS_OUT]);
    p.selectionTopkIndices = static_cast<int32_t const*>(inputs[kIN_SELECTION_TOPK_INDICES]);
    p.fullKRope = p.kRopeDim > 0 ? inputs[kIN_FULL_K_ROPE] : nullptr;
    p.fullKvCache = inputs[kIN_FULL_KV_CACHE];
    p.fullKvBlockTable = static_cast<int32_t const*>(inputs[kIN_FULL_KV_BLOCK_TABLE]);
    p.fullKvActualSeq = static_cast<int32_t const*>(inputs[kIN_FULL_KV_ACTUAL_SEQ]);
    p.selectionKvActualSeq = static_cast<int32_t*>(outputs[kOUT_SELECTION_KV_ACTUAL_SEQ]);
    p.workspace = workspace;
    // TensorRT does not tell a runtime plugin how much it reserved: getWorkspaceSize
    // reserved at least this much for every shape of the profile (this shape's topk
    // volume is at most the profile maximum's).
    p.workspaceBytes = kernels::getGatherSelectionWorkspaceSize(p);
    check(p.workspaceBytes == 0 || workspace != nullptr, "enqueue: the kernels need ", p.workspaceBytes,
        " workspace bytes and TensorRT gave none");
    return kernels::launchGatherSelectionKvCache(p, stream);
}

} // namespace plugin
} // namespace pytrt_kv
