#include "cpuChecks.h"

#include "NvInferRuntime.h"
#include "NvInferVersion.h"
#include "gatherSelectionKvCachePlugin.h"
#include "harnessCheck.h"
#include "mockTrt.h"
#include "pluginCommon.h"
#include "pluginDriver.h"
#include "scatterPaKvCachePlugin.h"
#include "shapeCases.h"

#include <algorithm>
#include <cstring>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

using namespace nvinfer1;
using pytrt_kv::plugin::dimsToString;

namespace pytrt_kv
{
namespace harness
{

int32_t commandFields()
{
    int32_t n = 0;
    IPluginCreatorInterface* const* creators = getCreators(n);
    std::ostringstream js;
    js << "{\"tensorrt_headers\": \"" << NV_TENSORRT_MAJOR << "." << NV_TENSORRT_MINOR << "." << NV_TENSORRT_PATCH
       << "\", \"plugins\": [";
    for (int32_t i = 0; i < n; ++i)
    {
        auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
        js << (i ? ", " : "") << "{\"interface\": " << jsonString(creators[i]->getInterfaceInfo().kind)
           << ", \"name\": " << jsonString(c->getPluginName()) << ", \"version\": " << jsonString(c->getPluginVersion())
           << ", \"namespace\": " << jsonString(c->getPluginNamespace()) << ", \"fields\": [";
        PluginFieldCollection const* fc = c->getFieldNames();
        for (int32_t k = 0; fc != nullptr && k < fc->nbFields; ++k)
        {
            js << (k ? ", " : "") << "{\"name\": " << jsonString(fc->fields[k].name)
               << ", \"type\": " << jsonString(fieldTypeName(fc->fields[k].type)) << "}";
        }
        js << "]";
        Fields none;
        PluginPtr p(c->createPlugin(c->getPluginName(), none.collection(), TensorRTPhase::kBUILD));
        if (p)
        {
            js << ", \"defaults\": {";
            auto values = readFields(runtimeOf(p.get())->getFieldsToSerialize());
            bool first = true;
            for (auto const& [name, v] : values)
            {
                js << (first ? "" : ", ") << jsonString(name) << ": "
                   << (v.type == PluginFieldType::kCHAR ? jsonString(v.s) : std::to_string(v.i));
                first = false;
            }
            IPluginV3OneBuildV2* b = buildOf(p.get());
            js << "}, \"nb_outputs\": " << b->getNbOutputs() << ", \"aliases\": [";
            for (int32_t o = 0; o < b->getNbOutputs(); ++o)
            {
                js << (o ? ", " : "") << b->getAliasedInput(o);
            }
            js << "]";
            Fields off;
            off.i32("alias_io", 0);
            PluginPtr q(c->createPlugin(c->getPluginName(), off.collection(), TensorRTPhase::kBUILD));
            js << ", \"aliases_alias_io_0\": [";
            for (int32_t o = 0; q && o < b->getNbOutputs(); ++o)
            {
                js << (o ? ", " : "") << buildOf(q.get())->getAliasedInput(o);
            }
            js << "]";
        }
        js << "}";
    }
    js << "]}";
    std::cout << js.str() << "\n";
    return 0;
}

namespace
{

void checkCreatorsAndFields()
{
    for (char const* name : {"ScatterPaKvCache", "GatherSelectionKvCache"})
    {
        std::string const N = name;
        IPluginCreatorV3One* c = findCreator(N);
        expect(c != nullptr, N + ": creator found through getCreators");
        if (c == nullptr)
        {
            continue;
        }
        expect(std::string(c->getPluginVersion()) == "1" && std::string(c->getPluginNamespace()) == "pytrt_kv",
            N + ": version 1, namespace pytrt_kv");

        // Fields exactly as the ONNX parser passes node attributes (INT as kINT32,
        // STRING as kCHAR without terminator), then a runtime-phase re-creation from
        // what getFieldsToSerialize wrote.
        Fields f;
        if (N == "ScatterPaKvCache")
        {
            f.str("cache_layout", "hnd").str("compress_mode", "").i32("alias_io", 0);
        }
        else
        {
            f.i32("selection_topk_block_size", 16).i32("alias_io", 0);
        }
        PluginPtr p = create(N, f);
        expect(p != nullptr, N + ": created from parser-style fields");
        if (!p)
        {
            continue;
        }
        expect(coreOf(p.get()) != nullptr && buildOf(p.get()) != nullptr && runtimeOf(p.get()) != nullptr,
            N + ": core, build and runtime capabilities");
        expect(std::string(coreOf(p.get())->getPluginName()) == N
                && std::string(coreOf(p.get())->getPluginVersion()) == "1"
                && std::string(coreOf(p.get())->getPluginNamespace()) == "pytrt_kv",
            N + ": plugin name/version/namespace match the creator");
        auto const written = readFields(runtimeOf(p.get())->getFieldsToSerialize());
        if (N == "ScatterPaKvCache")
        {
            expect(written.at("cache_layout").s == "hnd" && written.at("compress_mode").s.empty()
                    && written.at("alias_io").i == 0,
                N + ": serialized values are the given ones");
        }
        else
        {
            expect(written.at("selection_topk_block_size").i == 16 && written.at("alias_io").i == 0,
                N + ": serialized values are the given ones");
        }
        PluginPtr r(c->createPlugin(name, runtimeOf(p.get())->getFieldsToSerialize(), TensorRTPhase::kRUNTIME));
        expect(r != nullptr, N + ": re-created in the runtime phase from getFieldsToSerialize");
        if (r)
        {
            expect(readFields(runtimeOf(r.get())->getFieldsToSerialize()) == written,
                N + ": serialize -> create(kRUNTIME) -> serialize is the identity");
            expect(buildOf(r.get())->getAliasedInput(0) == -1, N + ": alias_io = 0 survives the round trip");
        }
        // clone and attachToContext deep-copy: the copy outlives the original.
        PluginPtr cl(p->clone());
        PluginPtr at(runtimeOf(p.get())->attachToContext(nullptr));
        p.reset();
        expect(cl && readFields(runtimeOf(cl.get())->getFieldsToSerialize()) == written,
            N + ": clone keeps the fields after the original is gone");
        expect(at && readFields(runtimeOf(at.get())->getFieldsToSerialize()) == written,
            N + ": attachToContext clones the fields");

        // int64 fields are accepted like int32 ones.
        Fields f64;
        if (N == "ScatterPaKvCache")
        {
            f64.str("cache_layout", "nd").i64("alias_io", 1);
        }
        else
        {
            f64.i64("selection_topk_block_size", 1).i64("alias_io", 1);
        }
        PluginPtr p64 = create(N, f64);
        expect(p64 != nullptr, N + ": kINT64 fields accepted");
        if (p64)
        {
            auto const w = readFields(runtimeOf(p64.get())->getFieldsToSerialize());
            expect(w.at("alias_io").i == 1 && w.at("alias_io").type == PluginFieldType::kINT32,
                N + ": kINT64 alias_io read and serialized as kINT32");
            expect(buildOf(p64.get())->getAliasedInput(0) >= 0, N + ": alias_io = 1 declares the alias");
        }
        // Strings with their terminator counted in `length` are the same string.
        if (N == "ScatterPaKvCache")
        {
            Fields fz;
            fz.raw("cache_layout", "nz", 3, PluginFieldType::kCHAR, 3);
            PluginPtr pz = create(N, fz);
            expect(pz && readFields(runtimeOf(pz.get())->getFieldsToSerialize()).at("cache_layout").s == "nz",
                N + ": a NUL-terminated kCHAR field reads as the same string");
        }
    }
}

void checkBadFields()
{
    struct Bad
    {
        std::string plugin;
        std::function<void(Fields&)> fill;
        std::string needle;
        std::string what;
    };
    std::string const S = "ScatterPaKvCache";
    std::string const G = "GatherSelectionKvCache";
    int64_t const huge = int64_t{1} << 40;
    float const f1 = 1.F;
    int32_t const two[2] = {1, 1};
    std::vector<Bad> bad = {
        {S, [](Fields& f) { f.str("cache_layout", "ndz"); }, "cache_layout", "unknown cache_layout value"},
        {S, [](Fields& f) { f.str("compress_mode", "mean"); }, "compress_mode", "unknown compress_mode value"},
        {S, [](Fields& f) { f.i32("alias_io", 2); }, "alias_io", "alias_io outside {0, 1}"},
        {S, [](Fields& f) { f.i32("alias_io", -1); }, "alias_io", "negative alias_io"},
        {S, [&](Fields& f) { f.raw("alias_io", &f1, sizeof(f1), PluginFieldType::kFLOAT32, 1); }, "alias_io",
            "alias_io as kFLOAT32"},
        {S, [&](Fields& f) { f.raw("alias_io", two, sizeof(two), PluginFieldType::kINT32, 2); }, "alias_io",
            "alias_io with two values"},
        {S, [](Fields& f) { f.i32("cache_layout", 1); }, "cache_layout", "cache_layout as an int"},
        {S, [](Fields& f) { f.nullData("cache_layout", PluginFieldType::kCHAR, 2); }, "cache_layout",
            "cache_layout with a null pointer"},
        {S, [](Fields& f) { f.nullData("alias_io", PluginFieldType::kINT32, 1); }, "alias_io",
            "alias_io with a null pointer"},
        {S, [](Fields& f) { f.str("cache_layuot", "nd"); }, "cache_layuot", "an unknown field name"},
        {S, [](Fields& f) { f.str("cache_layout", "nd").str("cache_layout", "nz"); }, "more than once",
            "a repeated field"},
        {G, [](Fields& f) { f.i32("selection_topk_block_size", 0); }, "selection_topk_block_size", "TBS 0"},
        {G, [&](Fields& f) { f.i64("selection_topk_block_size", huge); }, "selection_topk_block_size",
            "TBS beyond int32"},
        {G, [](Fields& f) { f.str("selection_topk_block_size", "64"); }, "selection_topk_block_size",
            "TBS as a string"},
        {G, [](Fields& f) { f.i32("cache_layout", 1); }, "cache_layout", "a scatter field given to the gather"},
    };
    for (auto& b : bad)
    {
        expectLoggedError(
            [&] {
                Fields f;
                b.fill(f);
                return create(b.plugin, f) == nullptr;
            },
            b.needle, b.plugin + ": createPlugin refuses " + b.what);
    }
    // A missing collection means "all defaults".
    IPluginCreatorV3One* c = findCreator(S);
    PluginPtr p(c->createPlugin(S.c_str(), nullptr, TensorRTPhase::kBUILD));
    expect(p != nullptr, "ScatterPaKvCache: createPlugin(nullptr fields) uses the defaults");
}

void checkFormats()
{
    std::string const S = "ScatterPaKvCache";
    std::string const G = "GatherSelectionKvCache";
    Fields nd;
    nd.str("cache_layout", "nd");
    PluginPtr s = create(S, nd);
    Fields nz;
    nz.str("cache_layout", "nz");
    PluginPtr sz = create(S, nz);
    Fields rope;
    rope.str("compress_mode", "rope");
    PluginPtr sr = create(S, rope);
    Fields none;
    PluginPtr g = create(G, none);
    if (!s || !sz || !sr || !g)
    {
        expect(false, "formats: plugins created");
        return;
    }
    std::vector<T> out;
    // Every dtype specs.py allows that TensorRT can express: all positions accepted,
    // with int32 and int64 indices.
    for (DataType t : {kF32, kF16, kBF, kI8, DataType::kFP8, kI32})
    {
        for (DataType idx : {kI32, kI64})
        {
            auto in = scatterNd(t, idx);
            bool ok = declaredOutputs(s.get(), in, out);
            int32_t refused = -1;
            expect(ok && formatsAccepted(s.get(), in, out, TensorFormat::kLINEAR, &refused),
                std::string("ScatterPaKvCache: linear ") + pytrt_kv::plugin::dataTypeName(t) + " with "
                    + pytrt_kv::plugin::dataTypeName(idx) + " indices accepted (refused pos " + std::to_string(refused)
                    + ")");
            expect(ok && out.size() == 2 && out[0].type == t && out[1].type == t,
                std::string("ScatterPaKvCache: output dtypes follow the caches for ")
                    + pytrt_kv::plugin::dataTypeName(t));
        }
    }
    for (DataType t : {kF16, kBF, kI8, kF32, DataType::kFP8})
    {
        auto in = gatherBsnd(t);
        bool ok = declaredOutputs(g.get(), in, out);
        expect(ok && formatsAccepted(g.get(), in, out),
            std::string("GatherSelectionKvCache: linear ") + pytrt_kv::plugin::dataTypeName(t) + " accepted");
        expect(
            ok && out.size() == 4 && out[0].type == t && out[1].type == t && out[2].type == kI32 && out[3].type == kI32,
            std::string("GatherSelectionKvCache: output dtypes for ") + pytrt_kv::plugin::dataTypeName(t));
    }
    // Refusals: types TensorRT cannot hand a plugin or the spec forbids, mixed groups,
    // non-linear formats.
    auto refusedAt = [&](IPluginV3* p, std::vector<T> in, int32_t pos, std::string const& what) {
        if (!declaredOutputs(p, in, out))
        {
            // getOutputDataTypes refused first (the dtype rules that need no dims, with a
            // message); supportsFormatCombination must refuse as well, with the outputs
            // typed as it would have declared them (the caches', and kINT32 lengths).
            out = in.size() == static_cast<size_t>(gatherOp::kNB_INPUTS)
                ? std::vector<T>{in[gatherOp::kIN_SELECTION_K_ROPE], in[gatherOp::kIN_SELECTION_KV_CACHE],
                      in[gatherOp::kIN_SELECTION_KV_BLOCK_STATUS],
                      T{kI32, {in[gatherOp::kIN_SELECTION_KV_BLOCK_TABLE].dims[0]}}}
                : std::vector<T>{in[scatterOp::kIN_KEY_CACHE], in[scatterOp::kIN_VALUE_CACHE]};
        }
        int32_t refused = -1;
        bool const all = formatsAccepted(p, in, out, TensorFormat::kLINEAR, &refused);
        expect(!all && refused == pos,
            what + " (refused at " + std::to_string(refused) + ", expected " + std::to_string(pos) + ")");
    };
    refusedAt(s.get(), scatterNd(DataType::kUINT8), scatterOp::kIN_KEY, "ScatterPaKvCache: kUINT8 key refused");
    refusedAt(s.get(), scatterNd(DataType::kBOOL), scatterOp::kIN_KEY, "ScatterPaKvCache: kBOOL key refused");
    refusedAt(
        s.get(), scatterNd(kF16, kF32), scatterOp::kIN_SLOT_MAPPING, "ScatterPaKvCache: float slot_mapping refused");
    {
        auto in = scatterNd();
        in[scatterOp::kIN_VALUE].type = kBF;
        in[scatterOp::kIN_VALUE_CACHE].type = kBF;
        refusedAt(s.get(), in, scatterOp::kIN_VALUE, "ScatterPaKvCache: value dtype != key dtype refused outside nz");
        declaredOutputs(sz.get(), in, out);
        expect(formatsAccepted(sz.get(), in, out), "ScatterPaKvCache: value dtype != key dtype accepted in nz");
    }
    {
        auto in = scatterNd();
        in[scatterOp::kIN_KEY_CACHE].type = kBF;
        refusedAt(s.get(), in, scatterOp::kIN_KEY_CACHE, "ScatterPaKvCache: key_cache dtype != key refused");
    }
    {
        auto in = scatterCompress(kF16, kI32, 6);
        in[scatterOp::kIN_COMPRESS_SEQ_OFFSETS].type = kI64;
        refusedAt(s.get(), in, scatterOp::kIN_COMPRESS_SEQ_OFFSETS, "ScatterPaKvCache: mixed index dtypes refused");
    }
    refusedAt(sr.get(), scatterCompress(kI8, kI32, 6), scatterOp::kIN_KEY,
        "ScatterPaKvCache: compress_mode rope refuses int8");
    {
        auto in = gatherBsnd();
        in[gatherOp::kIN_FULL_KV_CACHE].type = kBF;
        refusedAt(g.get(), in, gatherOp::kIN_FULL_KV_CACHE,
            "GatherSelectionKvCache: full_kv_cache dtype != selection cache refused");
        auto in2 = gatherBsnd();
        in2[gatherOp::kIN_SELECTION_KV_BLOCK_TABLE].type = kI64;
        refusedAt(g.get(), in2, gatherOp::kIN_SELECTION_KV_BLOCK_TABLE,
            "GatherSelectionKvCache: int64 block table refused (spec: int32)");
        refusedAt(g.get(), gatherBsnd(DataType::kUINT8), gatherOp::kIN_SELECTION_K_ROPE,
            "GatherSelectionKvCache: kUINT8 caches refused");
    }
    {
        auto in = scatterNd();
        declaredOutputs(s.get(), in, out);
        expect(!formatsAccepted(s.get(), in, out, TensorFormat::kCHW32), "ScatterPaKvCache: non-linear format refused");
        auto gi = gatherBsnd();
        declaredOutputs(g.get(), gi, out);
        expect(!formatsAccepted(g.get(), gi, out, TensorFormat::kHWC8), "GatherSelectionKvCache: non-linear refused");
    }
    // Unexpected input counts are refused, not indexed past.
    {
        auto in = scatterNd();
        in.pop_back();
        auto descs = dynamicDescs(in);
        expect(
            !buildOf(s.get())->supportsFormatCombination(0, descs.data(), 4, 2), "ScatterPaKvCache: 4 inputs refused");
        DataType types[4] = {kF16, kF16, kF16, kF16};
        DataType outs[2];
        expectLoggedError([&] { return buildOf(s.get())->getOutputDataTypes(outs, 2, types, 4) != 0; }, "inputs",
            "ScatterPaKvCache: getOutputDataTypes refuses 4 inputs");
    }
}

// An empty batch writes nothing and succeeds: enqueue must return before any CUDA call
// (no GPU here; every output is bound to its input, so nothing is copied either, and the
// actual-length output has no rows to clear). Without the plugins' early return the
// kernel launch fails on this machine.
void checkEmptyBatch()
{
    auto run = [&](std::string const& plugin, Fields& f, std::vector<T> const& in, std::string const& what) {
        PluginPtr p = create(plugin, f);
        std::vector<T> out;
        if (!p || !declaredOutputs(p.get(), in, out))
        {
            expect(false, what + ": outputs declared");
            return;
        }
        int32_t const nbIn = static_cast<int32_t>(in.size());
        int32_t const nbOut = static_cast<int32_t>(out.size());
        auto rin = runtimeDescs(in);
        auto rout = runtimeDescs(out);
        expect(runtimeOf(p.get())->onShapeChange(rin.data(), nbIn, rout.data(), nbOut) == 0, what + ": onShapeChange");
        std::vector<std::array<char, 64>> storage(in.size() + out.size());
        std::vector<void const*> ins;
        for (size_t i = 0; i < in.size(); ++i)
        {
            ins.push_back(storage[i].data());
        }
        std::vector<int32_t> const natural
            = plugin == "ScatterPaKvCache" ? std::vector<int32_t>{2, 3} : std::vector<int32_t>{0, 1, 3, -1};
        std::vector<void*> outs;
        for (int32_t o = 0; o < nbOut; ++o)
        {
            outs.push_back(natural[o] >= 0 ? storage[natural[o]].data() : storage[in.size() + o].data());
        }
        int32_t const before = gLogger.mErrors;
        expect(runtimeOf(p.get())->enqueue(rin.data(), rout.data(), ins.data(), outs.data(), nullptr, nullptr) == 0
                && gLogger.mErrors == before,
            what + ": enqueue succeeds without a launch");
    };
    Fields nd;
    nd.str("cache_layout", "nd");
    run("ScatterPaKvCache", nd,
        {{kF16, {0, 2, 8}}, {kF16, {0, 2, 4}}, {kF16, {4, 16, 2, 8}}, {kF16, {4, 16, 2, 4}}, {kI32, {0}}},
        "ScatterPaKvCache: T = 0");
    Fields compress;
    run("ScatterPaKvCache", compress,
        {{kF16, {0, 6, 3, 8}}, {kF16, {0, 6, 3, 8}}, {kF16, {10, 16, 1, 8}}, {kF16, {10, 16, 1, 8}}, {kI32, {0, 3}},
            {kI32, {0, 3}}, {kI32, {0}}, {kI32, {0}}},
        "ScatterPaKvCache: B = 0 (4-D key)");
    Fields gather;
    run("GatherSelectionKvCache", gather,
        {{kF16, {8, 64, 64}}, {kF16, {8, 64, 512}}, {kI32, {0, 4}}, {kI32, {2, 0, 1, 5}}, {kI32, {2, 0, 1, 4}},
            {kF16, {16, 128, 64}}, {kF16, {16, 128, 512}}, {kI32, {2, 8}}, {kI32, {2}}, {kI32, {2}}},
        "GatherSelectionKvCache: S = 0");
}

// The enqueue guards (PluginBase::beginEnqueue): enqueue before onShapeChange, after a
// refused one (\p bad, refused with \p badNeedle), or with other shapes (\p other) than
// the accepted \p good ones fails with a status, no crash.
void checkEnqueueGuards(std::string const& name, IPluginV3* p, std::vector<T> const& good,
    std::vector<T> const& outputs, std::vector<T> const& bad, char const* badNeedle, std::vector<T> const& other)
{
    auto const rin = runtimeDescs(good);
    auto const rout = runtimeDescs(outputs);
    auto const rinBad = runtimeDescs(bad);
    auto const rinOther = runtimeDescs(other);
    int32_t const nbIn = static_cast<int32_t>(good.size());
    int32_t const nbOut = static_cast<int32_t>(outputs.size());
    std::vector<void const*> ins(good.size(), nullptr);
    std::vector<void*> outs(outputs.size(), nullptr);
    auto const enqueueFails = [&](std::vector<PluginTensorDesc> const& in) {
        return runtimeOf(p)->enqueue(in.data(), rout.data(), ins.data(), outs.data(), nullptr, nullptr) != 0;
    };
    expectLoggedError(
        [&] { return enqueueFails(rin); }, "onShapeChange", name + ": enqueue before onShapeChange returns an error");
    expectLoggedError([&] { return runtimeOf(p)->onShapeChange(rinBad.data(), nbIn, rout.data(), nbOut) != 0; },
        badNeedle, name + ": onShapeChange refuses a bad input (" + badNeedle + ")");
    expectLoggedError([&] { return enqueueFails(rin); }, "onShapeChange",
        name + ": enqueue after a refused onShapeChange returns an error");
    expect(runtimeOf(p)->onShapeChange(rin.data(), nbIn, rout.data(), nbOut) == 0,
        name + ": onShapeChange accepts the valid shapes");
    expectLoggedError([&] { return enqueueFails(rinOther); }, "onShapeChange accepted",
        name + ": enqueue with other shapes than onShapeChange's fails");
}

void checkShapes()
{
    for (auto const& c : shapeCases())
    {
        Fields f;
        c.fields(f);
        PluginPtr p = create(c.plugin, f);
        if (!p)
        {
            expect(false, c.plugin + ": created for '" + c.label + "'");
            continue;
        }
        std::vector<T> out;
        bool const declared = declaredOutputs(p.get(), c.inputs, out);
        expect(declared, c.plugin + ": output types and shapes declared for '" + c.label + "'");
        if (!declared)
        {
            continue;
        }
        auto din = dynamicDescs(c.inputs);
        auto dout = dynamicDescs(out);
        int32_t const nbIn = static_cast<int32_t>(c.inputs.size());
        int32_t const nbOut = static_cast<int32_t>(out.size());
        // TensorRT-RTX asks for the aliases right after getOutputShapes, before
        // configurePlugin: they must already be right (no alias for a zero-element input).
        auto const aliasesRight = [&]() {
            bool const scatter = c.plugin == "ScatterPaKvCache";
            std::vector<int32_t> const natural
                = scatter ? std::vector<int32_t>{2, 3} : std::vector<int32_t>{0, 1, 3, -1};
            bool ok = true;
            for (int32_t o = 0; o < nbOut && o < static_cast<int32_t>(natural.size()); ++o)
            {
                int32_t const i = natural[o];
                bool const empty = i >= 0
                    && std::find(c.inputs[i].dims.begin(), c.inputs[i].dims.end(), 0) != c.inputs[i].dims.end();
                ok = ok && buildOf(p.get())->getAliasedInput(o) == (empty ? -1 : i);
            }
            return ok;
        };
        if (c.ok)
        {
            expect(aliasesRight(), c.plugin + ": aliases before configurePlugin for '" + c.label + "'");
            // Outputs are the caches, [R] for the actual lengths.
            bool shapesOk = true;
            if (c.plugin == "ScatterPaKvCache")
            {
                shapesOk = out[scatterOp::kOUT_KEY_CACHE_OUT].dims == c.inputs[scatterOp::kIN_KEY_CACHE].dims
                    && out[scatterOp::kOUT_VALUE_CACHE_OUT].dims == c.inputs[scatterOp::kIN_VALUE_CACHE].dims;
            }
            else
            {
                auto const& in = c.inputs;
                shapesOk = out[gatherOp::kOUT_SELECTION_K_ROPE_OUT].dims == in[gatherOp::kIN_SELECTION_K_ROPE].dims
                    && out[gatherOp::kOUT_SELECTION_KV_CACHE_OUT].dims == in[gatherOp::kIN_SELECTION_KV_CACHE].dims
                    && out[gatherOp::kOUT_SELECTION_KV_BLOCK_STATUS_OUT].dims
                        == in[gatherOp::kIN_SELECTION_KV_BLOCK_STATUS].dims
                    && out[gatherOp::kOUT_SELECTION_KV_ACTUAL_SEQ].dims
                        == std::vector<int64_t>{in[gatherOp::kIN_SELECTION_KV_BLOCK_TABLE].dims[0]};
            }
            expect(shapesOk, c.plugin + ": output shapes for '" + c.label + "'");
            expect(formatsAccepted(p.get(), c.inputs, out), c.plugin + ": formats accepted for '" + c.label + "'");
            int32_t const before = gLogger.mErrors;
            expect(buildOf(p.get())->configurePlugin(din.data(), nbIn, dout.data(), nbOut) == 0
                    && gLogger.mErrors == before,
                c.plugin + ": configurePlugin accepts '" + c.label + "'");
            // A key-only write's value_cache, C8's k_rope: placeholders (often constants), no alias.
            expect(aliasesRight(), c.plugin + ": aliases after configurePlugin for '" + c.label + "'");
            if (!hasWildcard(c.inputs))
            {
                auto rin = runtimeDescs(c.inputs);
                auto rout = runtimeDescs(out);
                expect(runtimeOf(p.get())->onShapeChange(rin.data(), nbIn, rout.data(), nbOut) == 0,
                    c.plugin + ": onShapeChange accepts '" + c.label + "'");
            }
            // Sizing the workspace from the profile maxima must not fail.
            int32_t const beforeWs = gLogger.mErrors;
            (void) buildOf(p.get())->getWorkspaceSize(din.data(), nbIn, dout.data(), nbOut);
            expect(gLogger.mErrors == beforeWs, c.plugin + ": getWorkspaceSize for '" + c.label + "'");
        }
        else
        {
            expectLoggedError(
                [&] { return buildOf(p.get())->configurePlugin(din.data(), nbIn, dout.data(), nbOut) != 0; }, c.needle,
                c.plugin + ": configurePlugin refuses '" + c.label + "'");
            auto rin = runtimeDescs(c.inputs);
            auto rout = runtimeDescs(out);
            expectLoggedError(
                [&] { return runtimeOf(p.get())->onShapeChange(rin.data(), nbIn, rout.data(), nbOut) != 0; }, c.needle,
                c.plugin + ": onShapeChange refuses '" + c.label + "'");
        }
    }
    Fields f;
    f.str("cache_layout", "nd");
    PluginPtr p = create("ScatterPaKvCache", f);
    if (p)
    {
        checkEnqueueGuards("ScatterPaKvCache", p.get(), scatterNd(), {{kF16, {4, 16, 2, 8}}, {kF16, {4, 16, 2, 4}}},
            withInput(scatterNd(), scatterOp::kIN_SLOT_MAPPING, {kI32, {4}}), "slot_mapping",
            withInputs(
                scatterNd(), {{scatterOp::kIN_KEY, {kF16, {4, 2, 8}}}, {scatterOp::kIN_SLOT_MAPPING, {kI32, {4}}}}));
    }
    Fields none;
    PluginPtr g = create("GatherSelectionKvCache", none);
    if (g)
    {
        auto const bad = withInput(gatherBsnd(), gatherOp::kIN_SELECTION_KV_BLOCK_TABLE, {kI32, {3, 4}});
        checkEnqueueGuards("GatherSelectionKvCache", g.get(), gatherBsnd(),
            {{kF16, {8, 64, 64}}, {kF16, {8, 64, 512}}, {kI32, {2, 2, 1, 5}}, {kI32, {4}}}, bad, "R >= B*S*H", bad);
        // Workspace: the kernels' size for B*S*K plan entries = the topk volume, BSND and
        // TND alike (B=2, S=2, K=32: 128 entries, not B*T*K for TND).
        Fields tbs1;
        tbs1.i32("selection_topk_block_size", 1);
        PluginPtr g1 = create("GatherSelectionKvCache", tbs1);
        for (bool tnd : {false, true})
        {
            auto const v = withTopk(gatherBsnd(), tnd ? std::vector<int64_t>{4, 1} : std::vector<int64_t>{2, 2, 1}, 32);
            std::vector<T> out;
            bool const declared = g1 && declaredOutputs(g1.get(), v, out);
            auto din = dynamicDescs(v);
            auto dout = dynamicDescs(out);
            expect(declared
                    && buildOf(g1.get())->getWorkspaceSize(din.data(), 10, dout.data(), 4)
                        == pytrt_kv::kernels::getGatherPlanWorkspaceSize(2 * 2 * 32),
                std::string("GatherSelectionKvCache: workspace of B*S*K plan entries for ") + (tnd ? "TND" : "BSND"));
        }
    }
}

} // namespace

int32_t commandCheck()
{
    checkCreatorsAndFields();
    checkBadFields();
    checkFormats();
    checkShapes();
    checkEmptyBatch();
    std::cout << "harness check: " << gChecks << " checks, " << gFailures << " failed\n";
    return gFailures == 0 ? 0 : 1;
}

} // namespace harness
} // namespace pytrt_kv
