#include "shapeCases.h"

using namespace nvinfer1;

namespace pytrt_kv
{
namespace harness
{

std::function<void(Fields&)> layout(std::string const& l, std::string const& mode)
{
    return [l, mode](Fields& f) {
        if (!l.empty())
        {
            f.str(scatterOp::kFIELD_CACHE_LAYOUT, l);
        }
        if (!mode.empty())
        {
            f.str(scatterOp::kFIELD_COMPRESS_MODE, mode);
        }
    };
}

std::function<void(Fields&)> tbs(int32_t v)
{
    return [v](Fields& f) { f.i32(gatherOp::kFIELD_SELECTION_TOPK_BLOCK_SIZE, v); };
}

std::vector<T> scatterNd(DataType k, DataType idx)
{
    return {{k, {5, 2, 8}}, {k, {5, 2, 4}}, {k, {4, 16, 2, 8}}, {k, {4, 16, 2, 4}}, {idx, {5}}};
}

std::vector<T> scatterCompress(DataType k, DataType idx, int64_t offsets)
{
    return {{k, {2, 6, 3, 8}}, {k, {2, 6, 3, 8}}, {k, {10, 16, 1, 8}}, {k, {10, 16, 1, 8}}, {idx, {2, 3}},
        {idx, {2, 3}}, {idx, {offsets}}, {idx, {2}}};
}

std::vector<T> gatherBsnd(DataType c)
{
    return {{c, {8, 64, 64}}, {c, {8, 64, 512}}, {kI32, {4, 4}}, {kI32, {2, 2, 1, 5}}, {kI32, {2, 2, 1, 4}},
        {c, {16, 128, 64}}, {c, {16, 128, 512}}, {kI32, {2, 8}}, {kI32, {2}}, {kI32, {2}}};
}

std::vector<T> withInput(std::vector<T> ts, int32_t index, T const& t)
{
    ts.at(static_cast<size_t>(index)) = t;
    return ts;
}

std::vector<T> withInputs(std::vector<T> ts, std::initializer_list<std::pair<int32_t, T>> changes)
{
    for (auto const& [index, t] : changes)
    {
        ts = withInput(std::move(ts), index, t);
    }
    return ts;
}

std::vector<T> withTopk(std::vector<T> ts, std::vector<int64_t> lead, int64_t k)
{
    std::vector<int64_t> topk = lead;
    topk.push_back(k);
    lead.push_back(k + 1);
    ts.at(gatherOp::kIN_SELECTION_TOPK_INDICES) = {kI32, topk};
    ts.at(gatherOp::kIN_SELECTION_KV_BLOCK_STATUS) = {kI32, lead};
    return ts;
}

std::vector<T> followedBy(std::vector<T> ts, std::initializer_list<T> more)
{
    ts.insert(ts.end(), more.begin(), more.end());
    return ts;
}

std::vector<ShapeCase> shapeCases()
{
    std::vector<ShapeCase> cs;
    std::string const S = scatterOp::kNAME;
    std::string const G = gatherOp::kNAME;
    cs.push_back({"scatter nd", S, layout("nd"), scatterNd(), true, ""});
    cs.push_back({"scatter nd int64 slots", S, layout("nd"), scatterNd(kBF, kI64), true, ""});
    cs.push_back({"scatter hnd", S, layout("hnd"),
        {{kF16, {5, 2, 8}}, {kF16, {5, 2, 4}}, {kF16, {4, 2, 16, 8}}, {kF16, {4, 2, 16, 4}}, {kI32, {5}}}, true, ""});
    // nz: L = 16 for fp16 (H*Dk = 16 -> [NB, 1, BS, 16]), L = 32 for int8 (H*Dv = 32).
    cs.push_back({"scatter nz, key and value dtypes differ", S, layout("nz"),
        {{kF16, {5, 2, 8}}, {kI8, {5, 2, 16}}, {kF16, {4, 1, 16, 16}}, {kI8, {4, 1, 16, 32}}, {kI32, {5}}}, true, ""});
    cs.push_back({"scatter key-only (zero-element value placeholders)", S, layout("nd"),
        {{kF16, {5, 2, 8}}, {kF16, {0}}, {kF16, {4, 16, 2, 8}}, {kF16, {0}}, {kI32, {5}}}, true, ""});
    cs.push_back({"scatter build-time wildcards", S, layout("nd"),
        {{kF16, {-1, 2, 8}}, {kF16, {-1, 2, 4}}, {kF16, {-1, 16, 2, 8}}, {kF16, {-1, 16, 2, 4}}, {kI32, {-1}}}, true,
        ""});
    cs.push_back({"scatter 3-D key with empty compress placeholders", S, layout("nd"),
        followedBy(scatterNd(), {{kI32, {0}}, {kI32, {0}}, {kI32, {0}}}), true, ""});
    cs.push_back(
        {"scatter compress rope (default with offsets)", S, layout(""), scatterCompress(kBF, kI64, 6), true, ""});
    cs.push_back({"scatter compress alibi (default without offsets), int8", S, layout(""),
        scatterCompress(kI8, kI32, 0), true, ""});
    cs.push_back({"scatter compress omni", S, layout("", "omni"), scatterCompress(kI8, kI32, 6), true, ""});
    // Refusals.
    cs.push_back({"scatter slot_mapping length", S, layout("nd"),
        withInput(scatterNd(), scatterOp::kIN_SLOT_MAPPING, {kI32, {4}}), false, "slot_mapping"});
    cs.push_back({"scatter key_cache heads", S, layout("nd"),
        withInput(scatterNd(), scatterOp::kIN_KEY_CACHE, {kF16, {4, 16, 3, 8}}), false, "key_cache"});
    cs.push_back({"scatter value_cache block size", S, layout("nd"),
        withInput(scatterNd(), scatterOp::kIN_VALUE_CACHE, {kF16, {4, 8, 2, 4}}), false, "value_cache"});
    cs.push_back({"scatter missing cache_layout for a 3-D key", S, layout(""), scatterNd(), false, "cache_layout"});
    cs.push_back(
        {"scatter compress_mode with a 3-D key", S, layout("nd", "rope"), scatterNd(), false, "compress_mode"});
    cs.push_back({"scatter value dtype differs outside nz", S, layout("nd"),
        withInputs(scatterNd(),
            {{scatterOp::kIN_VALUE, {kBF, {5, 2, 4}}}, {scatterOp::kIN_VALUE_CACHE, {kBF, {4, 16, 2, 4}}}}),
        false, "value"});
    cs.push_back({"scatter nz bad inner size", S, layout("nz"),
        {{kF16, {5, 2, 4}}, {kF16, {5, 2, 8}}, {kF16, {4, 1, 16, 8}}, {kF16, {4, 1, 16, 16}}, {kI32, {5}}}, false,
        "key_cache"});
    cs.push_back({"scatter non-empty compress tensors with a 3-D key", S, layout("nd"),
        followedBy(scatterNd(), {{kI32, {5}}, {kI32, {0}}, {kI32, {0}}}), false, "compress_lens"});
    cs.push_back({"scatter 4-D key with 5 inputs", S, layout(""),
        {{kF16, {2, 6, 3, 8}}, {kF16, {2, 6, 3, 8}}, {kF16, {10, 16, 1, 8}}, {kF16, {10, 16, 1, 8}}, {kI32, {2, 3}}},
        false, "8 inputs"});
    cs.push_back({"scatter rope needs offsets", S, layout("", "rope"), scatterCompress(kF16, kI32, 0), false,
        "compress_seq_offsets"});
    cs.push_back({"scatter rope needs a float dtype", S, layout(""), scatterCompress(kI8, kI32, 6), false, "rope"});
    cs.push_back({"scatter cache_layout with a 4-D key", S, layout("nd"), scatterCompress(kF16, kI32, 6), false,
        "cache_layout"});
    cs.push_back({"scatter offsets length", S, layout(""),
        withInput(scatterCompress(kF16, kI32, 6), scatterOp::kIN_COMPRESS_SEQ_OFFSETS, {kI32, {5}}), false,
        "compress_seq_offsets"});
    cs.push_back({"scatter seq_lens length", S, layout(""),
        withInput(scatterCompress(kF16, kI32, 6), scatterOp::kIN_SEQ_LENS, {kI32, {3}}), false, "seq_lens"});
    cs.push_back({"scatter compress cache dim 2", S, layout(""),
        withInput(scatterCompress(kF16, kI32, 6), scatterOp::kIN_KEY_CACHE, {kF16, {10, 16, 3, 8}}), false,
        "key_cache"});

    cs.push_back({"gather BSND fp16", G, tbs(64), gatherBsnd(), true, ""});
    cs.push_back({"gather BSND bf16 TBS 1, K 40", G, tbs(1), withTopk(gatherBsnd(kBF), {2, 2, 1}, 40), true, ""});
    cs.push_back({"gather TND", G, tbs(64), withTopk(gatherBsnd(), {4, 1}, 4), true, ""});
    cs.push_back({"gather C8 (zero-element k_rope pair), int8", G, tbs(64),
        withInputs(
            gatherBsnd(kI8), {{gatherOp::kIN_SELECTION_K_ROPE, {kI8, {0}}}, {gatherOp::kIN_FULL_K_ROPE, {kI8, {0}}}}),
        true, ""});
    // The k_rope rule of _gather.py check_gather: a [*, *, K_ROPE] pair is present even
    // with zero blocks; a zero-element pair is the quantised mode whatever its shapes.
    cs.push_back({"gather k_rope pair, selection caches with zero blocks", G, tbs(64),
        withInputs(gatherBsnd(),
            {{gatherOp::kIN_SELECTION_K_ROPE, {kF16, {0, 64, 64}}},
                {gatherOp::kIN_SELECTION_KV_CACHE, {kF16, {0, 64, 512}}}}),
        true, ""});
    cs.push_back({"gather k_rope pair, all caches with zero blocks", G, tbs(64),
        withInputs(gatherBsnd(),
            {{gatherOp::kIN_SELECTION_K_ROPE, {kF16, {0, 64, 64}}},
                {gatherOp::kIN_SELECTION_KV_CACHE, {kF16, {0, 64, 512}}},
                {gatherOp::kIN_FULL_K_ROPE, {kF16, {0, 128, 64}}},
                {gatherOp::kIN_FULL_KV_CACHE, {kF16, {0, 128, 512}}}}),
        true, ""});
    cs.push_back({"gather zero-element rank-3 k_rope pair, K_ROPE 0", G, tbs(64),
        withInputs(gatherBsnd(),
            {{gatherOp::kIN_SELECTION_K_ROPE, {kF16, {8, 64, 0}}}, {gatherOp::kIN_FULL_K_ROPE, {kF16, {16, 128, 0}}}}),
        true, ""});
    cs.push_back({"gather zero-element k_rope pair, K_ROPE differs", G, tbs(64),
        withInputs(gatherBsnd(),
            {{gatherOp::kIN_SELECTION_K_ROPE, {kF16, {0, 64, 64}}}, {gatherOp::kIN_FULL_K_ROPE, {kF16, {0, 128, 32}}}}),
        true, ""});
    cs.push_back({"gather wildcards", G, tbs(64),
        {{kF16, {-1, 64, 64}}, {kF16, {-1, 64, 512}}, {kI32, {-1, 4}}, {kI32, {-1, 2, 1, 5}}, {kI32, {-1, 2, 1, 4}},
            {kF16, {-1, 128, 64}}, {kF16, {-1, 128, 512}}, {kI32, {-1, 8}}, {kI32, {-1}}, {kI32, {-1}}},
        true, ""});
    cs.push_back({"gather H != 1", G, tbs(64), withTopk(gatherBsnd(), {2, 2, 2}, 4), false, "H == 1"});
    cs.push_back({"gather TND T % B", G, tbs(64), withTopk(gatherBsnd(), {3, 1}, 4), false, "T % B"});
    cs.push_back({"gather SBS % TBS", G, tbs(48), gatherBsnd(), false, "selection_topk_block_size"});
    // docs/SPEC.md G2: any TBS with K <= 2048 (the Ascend limit K > 32 => TBS 1 is lifted).
    cs.push_back({"gather K > 32 with TBS > 1", G, tbs(64),
        withTopk(withInput(gatherBsnd(), gatherOp::kIN_SELECTION_KV_BLOCK_TABLE, {kI32, {4, 40}}), {2, 2, 1}, 40), true,
        ""});
    cs.push_back({"gather R < B*S", G, tbs(64),
        withInput(gatherBsnd(), gatherOp::kIN_SELECTION_KV_BLOCK_TABLE, {kI32, {3, 4}}), false, "R >= B*S*H"});
    cs.push_back({"gather S_MAX_BLOCK_NUM too small", G, tbs(64),
        withInput(gatherBsnd(), gatherOp::kIN_SELECTION_KV_BLOCK_TABLE, {kI32, {4, 3}}), false, "S_MAX_BLOCK_NUM"});
    cs.push_back({"gather one k_rope zero-element", G, tbs(64),
        withInput(gatherBsnd(), gatherOp::kIN_SELECTION_K_ROPE, {kF16, {0}}), false,
        "both present or both zero-element"});
    cs.push_back({"gather k_rope pair K_ROPE differs", G, tbs(64),
        withInput(gatherBsnd(), gatherOp::kIN_FULL_K_ROPE, {kF16, {16, 128, 32}}), false, "full_k_rope"});
    cs.push_back({"gather zero-block k_rope unlike its cache", G, tbs(64),
        withInput(gatherBsnd(), gatherOp::kIN_SELECTION_K_ROPE, {kF16, {0, 64, 64}}), false, "selection_k_rope"});
    cs.push_back({"gather status K+1", G, tbs(64),
        withInput(gatherBsnd(), gatherOp::kIN_SELECTION_KV_BLOCK_STATUS, {kI32, {2, 2, 1, 4}}), false,
        "selection_kv_block_status"});
    cs.push_back({"gather full kv width", G, tbs(64),
        withInput(gatherBsnd(), gatherOp::kIN_FULL_KV_CACHE, {kF16, {16, 128, 256}}), false, "full_kv_cache"});
    cs.push_back({"gather full_kv_actual_seq length", G, tbs(64),
        withInput(gatherBsnd(), gatherOp::kIN_FULL_KV_ACTUAL_SEQ, {kI32, {3}}), false, "full_kv_actual_seq"});
    return cs;
}

} // namespace harness
} // namespace pytrt_kv
