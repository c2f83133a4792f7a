/*
 * pytrt_kv plugin harness: drives both plugins through their creators the way TensorRT
 * does, without libnvinfer (docs/ARCHITECTURE.md, "Verifying without TensorRT").
 *
 *   pytrt_kv_plugin_harness fields          creators, field names/types, defaults, aliases as JSON
 *   pytrt_kv_plugin_harness check           CPU checks: fields as the ONNX parser passes them,
 *                                           serialize round-trip, clone, bad fields refused,
 *                                           formats, output types/shapes, shape validation
 *   pytrt_kv_plugin_harness cases DIR...    CPU: the build/runtime-phase steps of those cases
 *                                           (formats, output types/shapes vs the reference,
 *                                           configure, serialize, re-create, onShapeChange)
 *   pytrt_kv_plugin_harness run DIR...      GPU: enqueue on the cases that plugins/harness/
 *                                           makeCases.py wrote from pytrt_kv.reference, in place
 *                                           and with separate output buffers, bit-exact
 * Exit status 0 when every check passed, 1 otherwise, 2 for a usage or setup error.
 */
#include "NvInferRuntime.h"
#include "NvInferVersion.h"
#include "gatherSelectionKvCachePlugin.h"
#include "harnessIo.h"
#include "pluginCommon.h"
#include "scatterPaKvCachePlugin.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
extern "C" void setLoggerFinder(nvinfer1::ILoggerFinder* finder);

using namespace nvinfer1;
using pytrt_kv::plugin::dimsToString;

namespace
{

// --- logging: what the plugins send to "TensorRT's" logger ------------------------------

class CaptureLogger : public ILogger
{
public:
    void log(Severity severity, AsciiChar const* msg) noexcept override
    {
        if (severity <= Severity::kERROR)
        {
            ++mErrors;
            mLast = msg;
        }
        if (mEcho)
        {
            std::cerr << "  [log] " << msg << "\n";
        }
    }
    int32_t mErrors{0};
    std::string mLast;
    bool mEcho{false};
};

CaptureLogger gLogger;

class Finder : public ILoggerFinder
{
public:
    ILogger* findLogger() noexcept override
    {
        return &gLogger;
    }
    ~Finder() override = default;
};

Finder gFinder;

// --- checks -------------------------------------------------------------------------

int32_t gChecks{0};
int32_t gFailures{0};

void expect(bool ok, std::string const& what)
{
    ++gChecks;
    if (!ok)
    {
        ++gFailures;
        std::cout << "FAIL: " << what << "\n";
    }
}

//! Runs \p f, expecting it to fail with an error logged whose text contains \p needle.
void expectLoggedError(std::function<bool()> const& f, std::string const& needle, std::string const& what)
{
    int32_t const before = gLogger.mErrors;
    bool const failed = f();
    bool const logged = gLogger.mErrors > before;
    expect(failed && logged && gLogger.mLast.find(needle) != std::string::npos,
        what + " (failed=" + std::to_string(failed) + ", logged=" + std::to_string(logged) + ", last log: '"
            + (logged ? gLogger.mLast : std::string()) + "', wanted '" + needle + "')");
}

// --- constant-only dimension expressions (the builder's role in getOutputShapes) --------

class ConstExprImpl : public apiv::VDimensionExpr
{
public:
    explicit ConstExprImpl(int64_t v)
        : mValue(v)
    {
    }
    bool isConstant() const override
    {
        return true;
    }
    int64_t getConstantValue() const override
    {
        return mValue;
    }
    bool isSizeTensor() const override
    {
        return false;
    }

private:
    int64_t mValue;
};

class ConstExpr : public IDimensionExpr
{
public:
    explicit ConstExpr(int64_t v)
        : mStore(v)
    {
        mImpl = &mStore;
    }
    ~ConstExpr() noexcept override = default;

private:
    ConstExprImpl mStore;
};

class ExprBuilderImpl : public apiv::VExprBuilder
{
public:
    IDimensionExpr const* constant(int64_t value) override
    {
        mExprs.push_back(std::make_unique<ConstExpr>(value));
        return mExprs.back().get();
    }
    IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& a, IDimensionExpr const& b) override
    {
        int64_t const x = a.getConstantValue();
        int64_t const y = b.getConstantValue();
        switch (op)
        {
        case DimensionOperation::kSUM: return constant(x + y);
        case DimensionOperation::kPROD: return constant(x * y);
        case DimensionOperation::kMAX: return constant(x > y ? x : y);
        case DimensionOperation::kMIN: return constant(x < y ? x : y);
        case DimensionOperation::kSUB: return constant(x - y);
        case DimensionOperation::kEQUAL: return constant(x == y);
        case DimensionOperation::kLESS: return constant(x < y);
        case DimensionOperation::kFLOOR_DIV: return y == 0 ? nullptr : constant(x / y);
        case DimensionOperation::kCEIL_DIV: return y == 0 ? nullptr : constant((x + y - 1) / y);
        }
        return nullptr;
    }
    IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override
    {
        return nullptr;
    }

private:
    std::deque<std::unique_ptr<ConstExpr>> mExprs;
};

class ExprBuilder : public IExprBuilder
{
public:
    ExprBuilder()
    {
        mImpl = &mStore;
    }
    ~ExprBuilder() noexcept override = default;

private:
    ExprBuilderImpl mStore;
};

// --- plugin access --------------------------------------------------------------------

IPluginCreatorV3One* findCreator(std::string const& name)
{
    int32_t n = 0;
    IPluginCreatorInterface* const* creators = getCreators(n);
    for (int32_t i = 0; i < n; ++i)
    {
        if (std::strcmp(creators[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") != 0)
        {
            continue;
        }
        auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
        if (name == c->getPluginName())
        {
            return c;
        }
    }
    return nullptr;
}

IPluginV3OneCore* coreOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
}

IPluginV3OneBuildV2* buildOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
}

IPluginV3OneRuntime* runtimeOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
}

using PluginPtr = std::unique_ptr<IPluginV3>;

//! A PluginFieldCollection with owned storage, filled the way a producer would.
class Fields
{
public:
    Fields& i32(char const* name, int32_t v)
    {
        return raw(name, &v, sizeof(v), PluginFieldType::kINT32, 1);
    }
    Fields& i64(char const* name, int64_t v)
    {
        return raw(name, &v, sizeof(v), PluginFieldType::kINT64, 1);
    }
    //! As the ONNX parser passes a STRING attribute: the characters, no terminator.
    Fields& str(char const* name, std::string const& s)
    {
        return raw(name, s.data(), s.size(), PluginFieldType::kCHAR, static_cast<int32_t>(s.size()));
    }
    Fields& raw(char const* name, void const* data, size_t bytes, PluginFieldType type, int32_t length)
    {
        mNames.emplace_back(name);
        mData.emplace_back(static_cast<uint8_t const*>(data), static_cast<uint8_t const*>(data) + bytes);
        mTypes.push_back(type);
        mLengths.push_back(length);
        return *this;
    }
    Fields& nullData(char const* name, PluginFieldType type, int32_t length)
    {
        mNames.emplace_back(name);
        mData.emplace_back();
        mTypes.push_back(type);
        mLengths.push_back(-length - 1); // marker: pass a null pointer
        return *this;
    }
    PluginFieldCollection const* collection()
    {
        mFields.clear();
        for (size_t i = 0; i < mNames.size(); ++i)
        {
            bool const null = mLengths[i] < 0;
            mFields.emplace_back(mNames[i].c_str(), null ? nullptr : mData[i].data(), mTypes[i],
                null ? -mLengths[i] - 1 : mLengths[i]);
        }
        mCollection.nbFields = static_cast<int32_t>(mFields.size());
        mCollection.fields = mFields.data();
        return &mCollection;
    }

private:
    std::deque<std::string> mNames;
    std::deque<std::vector<uint8_t>> mData;
    std::vector<PluginFieldType> mTypes;
    std::vector<int32_t> mLengths;
    std::vector<PluginField> mFields;
    PluginFieldCollection mCollection{};
};

PluginPtr create(std::string const& plugin, Fields& f, TensorRTPhase phase = TensorRTPhase::kBUILD)
{
    IPluginCreatorV3One* c = findCreator(plugin);
    return PluginPtr(c == nullptr ? nullptr : c->createPlugin(plugin.c_str(), f.collection(), phase));
}

struct FieldValue
{
    PluginFieldType type{PluginFieldType::kUNKNOWN};
    int64_t i{0};
    std::string s;
    bool operator==(FieldValue const& o) const
    {
        return type == o.type && i == o.i && s == o.s;
    }
};

std::map<std::string, FieldValue> readFields(PluginFieldCollection const* fc)
{
    std::map<std::string, FieldValue> out;
    for (int32_t k = 0; fc != nullptr && k < fc->nbFields; ++k)
    {
        PluginField const& f = fc->fields[k];
        FieldValue v;
        v.type = f.type;
        if (f.type == PluginFieldType::kINT32 && f.length == 1)
        {
            int32_t x{0};
            std::memcpy(&x, f.data, sizeof(x));
            v.i = x;
        }
        else if (f.type == PluginFieldType::kINT64 && f.length == 1)
        {
            std::memcpy(&v.i, f.data, sizeof(v.i));
        }
        else if (f.type == PluginFieldType::kCHAR)
        {
            auto const* c = static_cast<char const*>(f.data);
            size_t n = 0;
            while (n < static_cast<size_t>(f.length) && c[n] != '\0')
            {
                ++n;
            }
            v.s.assign(c, n);
        }
        out[f.name] = v;
    }
    return out;
}

char const* fieldTypeName(PluginFieldType t)
{
    switch (t)
    {
    case PluginFieldType::kINT32: return "kINT32";
    case PluginFieldType::kINT64: return "kINT64";
    case PluginFieldType::kCHAR: return "kCHAR";
    default: return "other";
    }
}

std::string jsonString(std::string const& s)
{
    std::string out = "\"";
    for (char c : s)
    {
        if (c == '"' || c == '\\')
        {
            out += '\\';
        }
        out += c;
    }
    return out + "\"";
}

// --- tensor descriptions --------------------------------------------------------------

struct T
{
    DataType type;
    std::vector<int64_t> dims;
};

Dims makeDims(std::vector<int64_t> const& v)
{
    Dims d{};
    d.nbDims = static_cast<int32_t>(v.size());
    for (size_t i = 0; i < v.size(); ++i)
    {
        d.d[i] = v[i];
    }
    return d;
}

std::vector<DynamicPluginTensorDesc> dynamicDescs(std::vector<T> const& ts, TensorFormat format = TensorFormat::kLINEAR)
{
    std::vector<DynamicPluginTensorDesc> out(ts.size());
    for (size_t i = 0; i < ts.size(); ++i)
    {
        out[i].desc.dims = makeDims(ts[i].dims);
        out[i].desc.type = ts[i].type;
        out[i].desc.format = format;
        out[i].desc.scale = -1.F;
        Dims mx = out[i].desc.dims;
        for (int32_t a = 0; a < mx.nbDims; ++a)
        {
            mx.d[a] = mx.d[a] < 0 ? 64 : mx.d[a]; // a profile's maximum for a wildcard
        }
        out[i].min = mx;
        out[i].opt = mx;
        out[i].max = mx;
    }
    return out;
}

std::vector<PluginTensorDesc> runtimeDescs(std::vector<T> const& ts)
{
    std::vector<PluginTensorDesc> out(ts.size());
    for (size_t i = 0; i < ts.size(); ++i)
    {
        out[i].dims = makeDims(ts[i].dims);
        out[i].type = ts[i].type;
        out[i].format = TensorFormat::kLINEAR;
        out[i].scale = -1.F;
    }
    return out;
}

bool hasWildcard(std::vector<T> const& ts)
{
    for (auto const& t : ts)
    {
        for (int64_t d : t.dims)
        {
            if (d < 0)
            {
                return true;
            }
        }
    }
    return false;
}

//! Output types and shapes the plugin declares for \p inputs; false when it refuses.
bool declaredOutputs(IPluginV3* p, std::vector<T> const& inputs, std::vector<T>& outputs)
{
    IPluginV3OneBuildV2* b = buildOf(p);
    int32_t const nbOut = b->getNbOutputs();
    int32_t const nbIn = static_cast<int32_t>(inputs.size());
    std::vector<DataType> inTypes;
    for (auto const& t : inputs)
    {
        inTypes.push_back(t.type);
    }
    std::vector<DataType> outTypes(nbOut, DataType::kBOOL);
    if (b->getOutputDataTypes(outTypes.data(), nbOut, inTypes.data(), nbIn) != 0)
    {
        return false;
    }
    ExprBuilder builder;
    std::vector<DimsExprs> in(nbIn);
    for (int32_t i = 0; i < nbIn; ++i)
    {
        in[i].nbDims = static_cast<int32_t>(inputs[i].dims.size());
        for (int32_t a = 0; a < in[i].nbDims; ++a)
        {
            in[i].d[a] = builder.constant(inputs[i].dims[a]);
        }
    }
    std::vector<DimsExprs> out(nbOut);
    if (b->getOutputShapes(in.data(), nbIn, nullptr, 0, out.data(), nbOut, builder) != 0)
    {
        return false;
    }
    outputs.clear();
    for (int32_t o = 0; o < nbOut; ++o)
    {
        T t{outTypes[o], {}};
        for (int32_t a = 0; a < out[o].nbDims; ++a)
        {
            t.dims.push_back(out[o].d[a] != nullptr && out[o].d[a]->isConstant() ? out[o].d[a]->getConstantValue() : -2);
        }
        outputs.push_back(t);
    }
    return true;
}

//! Every position of the combination accepted, asked in TensorRT's order.
bool formatsAccepted(IPluginV3* p, std::vector<T> const& inputs, std::vector<T> const& outputs,
    TensorFormat format = TensorFormat::kLINEAR, int32_t* firstRefused = nullptr)
{
    std::vector<T> all = inputs;
    all.insert(all.end(), outputs.begin(), outputs.end());
    auto descs = dynamicDescs(all, format);
    for (int32_t pos = 0; pos < static_cast<int32_t>(all.size()); ++pos)
    {
        if (!buildOf(p)->supportsFormatCombination(pos, descs.data(), static_cast<int32_t>(inputs.size()),
                static_cast<int32_t>(outputs.size())))
        {
            if (firstRefused != nullptr)
            {
                *firstRefused = pos;
            }
            return false;
        }
    }
    return true;
}

// --- the cases the CPU checks use -------------------------------------------------------

struct ShapeCase
{
    std::string label;
    std::string plugin;
    std::function<void(Fields&)> fields;
    std::vector<T> inputs;
    bool ok;
    std::string needle; //!< expected in the logged error when !ok
};

constexpr DataType kF16 = DataType::kHALF;
constexpr DataType kBF = DataType::kBF16;
constexpr DataType kF32 = DataType::kFLOAT;
constexpr DataType kI8 = DataType::kINT8;
constexpr DataType kI32 = DataType::kINT32;
constexpr DataType kI64 = DataType::kINT64;

std::function<void(Fields&)> layout(std::string const& l, std::string const& mode = "")
{
    return [l, mode](Fields& f) {
        if (!l.empty())
        {
            f.str("cache_layout", l);
        }
        if (!mode.empty())
        {
            f.str("compress_mode", mode);
        }
    };
}

std::function<void(Fields&)> tbs(int32_t v)
{
    return [v](Fields& f) { f.i32("selection_topk_block_size", v); };
}

// 3-D scatter, T=5 tokens, H=2 heads, Dk=8, Dv=4, NB=4 blocks of BS=16.
std::vector<T> scatterNd(DataType k = kF16, DataType idx = kI32)
{
    return {{k, {5, 2, 8}}, {k, {5, 2, 4}}, {k, {4, 16, 2, 8}}, {k, {4, 16, 2, 4}}, {idx, {5}}};
}

// 4-D scatter, B=2, Smax=6, H=3, Dk=Dv=8, NB=10, BS=16.
std::vector<T> scatterCompress(DataType k, DataType idx, int64_t offsets)
{
    return {{k, {2, 6, 3, 8}}, {k, {2, 6, 3, 8}}, {k, {10, 16, 1, 8}}, {k, {10, 16, 1, 8}}, {idx, {2, 3}},
        {idx, {2, 3}}, {idx, {offsets}}, {idx, {2}}};
}

// BSND gather, B=2, S=2, H=1, K=4, TBS=64 (default), SBS=64, FBS=128, R=4, KV=512, K_ROPE=64.
std::vector<T> gatherBsnd(DataType c = kF16)
{
    return {{c, {8, 64, 64}}, {c, {8, 64, 512}}, {kI32, {4, 4}}, {kI32, {2, 2, 1, 5}}, {kI32, {2, 2, 1, 4}},
        {c, {16, 128, 64}}, {c, {16, 128, 512}}, {kI32, {2, 8}}, {kI32, {2}}, {kI32, {2}}};
}

std::vector<ShapeCase> shapeCases()
{
    std::vector<ShapeCase> cs;
    auto with = [](std::vector<T> ts, size_t i, T t) {
        ts[i] = t;
        return ts;
    };
    std::string const S = "ScatterPaKvCache";
    std::string const G = "GatherSelectionKvCache";
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
        [&] {
            auto v = scatterNd();
            v.push_back({kI32, {0}});
            v.push_back({kI32, {0}});
            v.push_back({kI32, {0}});
            return v;
        }(),
        true, ""});
    cs.push_back({"scatter compress rope (default with offsets)", S, layout(""), scatterCompress(kBF, kI64, 6), true, ""});
    cs.push_back({"scatter compress alibi (default without offsets), int8", S, layout(""),
        scatterCompress(kI8, kI32, 0), true, ""});
    cs.push_back({"scatter compress omni", S, layout("", "omni"), scatterCompress(kI8, kI32, 6), true, ""});
    // Refusals.
    cs.push_back({"scatter slot_mapping length", S, layout("nd"), with(scatterNd(), 4, {kI32, {4}}), false,
        "slot_mapping"});
    cs.push_back({"scatter key_cache heads", S, layout("nd"), with(scatterNd(), 2, {kF16, {4, 16, 3, 8}}), false,
        "key_cache"});
    cs.push_back({"scatter value_cache block size", S, layout("nd"), with(scatterNd(), 3, {kF16, {4, 8, 2, 4}}), false,
        "value_cache"});
    cs.push_back({"scatter missing cache_layout for a 3-D key", S, layout(""), scatterNd(), false, "cache_layout"});
    cs.push_back({"scatter compress_mode with a 3-D key", S, layout("nd", "rope"), scatterNd(), false,
        "compress_mode"});
    cs.push_back({"scatter value dtype differs outside nz", S, layout("nd"),
        with(with(scatterNd(), 1, {kBF, {5, 2, 4}}), 3, {kBF, {4, 16, 2, 4}}), false, "value"});
    cs.push_back({"scatter nz bad inner size", S, layout("nz"),
        {{kF16, {5, 2, 4}}, {kF16, {5, 2, 8}}, {kF16, {4, 1, 16, 8}}, {kF16, {4, 1, 16, 16}}, {kI32, {5}}}, false,
        "key_cache"});
    cs.push_back({"scatter non-empty compress tensors with a 3-D key", S, layout("nd"),
        [&] {
            auto v = scatterNd();
            v.push_back({kI32, {5}});
            v.push_back({kI32, {0}});
            v.push_back({kI32, {0}});
            return v;
        }(),
        false, "compress_lens"});
    cs.push_back({"scatter 4-D key with 5 inputs", S, layout(""),
        {{kF16, {2, 6, 3, 8}}, {kF16, {2, 6, 3, 8}}, {kF16, {10, 16, 1, 8}}, {kF16, {10, 16, 1, 8}}, {kI32, {2, 3}}},
        false, "8 inputs"});
    cs.push_back({"scatter rope needs offsets", S, layout("", "rope"), scatterCompress(kF16, kI32, 0), false,
        "compress_seq_offsets"});
    cs.push_back({"scatter rope needs a float dtype", S, layout(""), scatterCompress(kI8, kI32, 6), false, "rope"});
    cs.push_back({"scatter cache_layout with a 4-D key", S, layout("nd"), scatterCompress(kF16, kI32, 6), false,
        "cache_layout"});
    cs.push_back({"scatter offsets length", S, layout(""), with(scatterCompress(kF16, kI32, 6), 6, {kI32, {5}}), false,
        "compress_seq_offsets"});
    cs.push_back({"scatter seq_lens length", S, layout(""), with(scatterCompress(kF16, kI32, 6), 7, {kI32, {3}}), false,
        "seq_lens"});
    cs.push_back({"scatter compress cache dim 2", S, layout(""),
        with(scatterCompress(kF16, kI32, 6), 2, {kF16, {10, 16, 3, 8}}), false, "key_cache"});

    cs.push_back({"gather BSND fp16", G, tbs(64), gatherBsnd(), true, ""});
    cs.push_back({"gather BSND bf16 TBS 1, K 40", G, tbs(1),
        [&] {
            auto v = gatherBsnd(kBF);
            v[3] = {kI32, {2, 2, 1, 41}};
            v[4] = {kI32, {2, 2, 1, 40}};
            return v;
        }(),
        true, ""});
    cs.push_back({"gather TND", G, tbs(64), with(with(gatherBsnd(), 3, {kI32, {4, 1, 5}}), 4, {kI32, {4, 1, 4}}), true,
        ""});
    cs.push_back({"gather C8 (zero-element k_rope pair), int8", G, tbs(64),
        with(with(gatherBsnd(kI8), 0, {kI8, {0}}), 5, {kI8, {0}}), true, ""});
    // The k_rope rule of _gather.py check_gather: a [*, *, K_ROPE] pair is present even
    // with zero blocks; a zero-element pair is the quantised mode whatever its shapes.
    cs.push_back({"gather k_rope pair, selection caches with zero blocks", G, tbs(64),
        with(with(gatherBsnd(), 0, {kF16, {0, 64, 64}}), 1, {kF16, {0, 64, 512}}), true, ""});
    cs.push_back({"gather k_rope pair, all caches with zero blocks", G, tbs(64),
        [&] {
            auto v = gatherBsnd();
            v[0] = {kF16, {0, 64, 64}};
            v[1] = {kF16, {0, 64, 512}};
            v[5] = {kF16, {0, 128, 64}};
            v[6] = {kF16, {0, 128, 512}};
            return v;
        }(),
        true, ""});
    cs.push_back({"gather zero-element rank-3 k_rope pair, K_ROPE 0", G, tbs(64),
        with(with(gatherBsnd(), 0, {kF16, {8, 64, 0}}), 5, {kF16, {16, 128, 0}}), true, ""});
    cs.push_back({"gather zero-element k_rope pair, K_ROPE differs", G, tbs(64),
        with(with(gatherBsnd(), 0, {kF16, {0, 64, 64}}), 5, {kF16, {0, 128, 32}}), true, ""});
    cs.push_back({"gather wildcards", G, tbs(64),
        {{kF16, {-1, 64, 64}}, {kF16, {-1, 64, 512}}, {kI32, {-1, 4}}, {kI32, {-1, 2, 1, 5}}, {kI32, {-1, 2, 1, 4}},
            {kF16, {-1, 128, 64}}, {kF16, {-1, 128, 512}}, {kI32, {-1, 8}}, {kI32, {-1}}, {kI32, {-1}}},
        true, ""});
    cs.push_back({"gather H != 1", G, tbs(64),
        with(with(gatherBsnd(), 3, {kI32, {2, 2, 2, 5}}), 4, {kI32, {2, 2, 2, 4}}), false, "H == 1"});
    cs.push_back({"gather TND T % B", G, tbs(64), with(with(gatherBsnd(), 3, {kI32, {3, 1, 5}}), 4, {kI32, {3, 1, 4}}),
        false, "T % B"});
    cs.push_back({"gather SBS % TBS", G, tbs(48), gatherBsnd(), false, "selection_topk_block_size"});
    // docs/SPEC.md G2: any TBS with K <= 2048 (the Ascend limit K > 32 => TBS 1 is lifted).
    cs.push_back({"gather K > 32 with TBS > 1", G, tbs(64),
        with(with(with(gatherBsnd(), 2, {kI32, {4, 40}}), 3, {kI32, {2, 2, 1, 41}}), 4, {kI32, {2, 2, 1, 40}}),
        true, ""});
    cs.push_back({"gather R < B*S", G, tbs(64), with(gatherBsnd(), 2, {kI32, {3, 4}}), false, "R >= B*S*H"});
    cs.push_back({"gather S_MAX_BLOCK_NUM too small", G, tbs(64), with(gatherBsnd(), 2, {kI32, {4, 3}}), false,
        "S_MAX_BLOCK_NUM"});
    cs.push_back({"gather one k_rope zero-element", G, tbs(64), with(gatherBsnd(), 0, {kF16, {0}}), false,
        "both present or both zero-element"});
    cs.push_back({"gather k_rope pair K_ROPE differs", G, tbs(64), with(gatherBsnd(), 5, {kF16, {16, 128, 32}}), false,
        "full_k_rope"});
    cs.push_back({"gather zero-block k_rope unlike its cache", G, tbs(64), with(gatherBsnd(), 0, {kF16, {0, 64, 64}}),
        false, "selection_k_rope"});
    cs.push_back({"gather status K+1", G, tbs(64), with(gatherBsnd(), 3, {kI32, {2, 2, 1, 4}}), false,
        "selection_kv_block_status"});
    cs.push_back({"gather full kv width", G, tbs(64), with(gatherBsnd(), 6, {kF16, {16, 128, 256}}), false,
        "full_kv_cache"});
    cs.push_back({"gather full_kv_actual_seq length", G, tbs(64), with(gatherBsnd(), 8, {kI32, {3}}), false,
        "full_kv_actual_seq"});
    return cs;
}

// --- subcommand: fields ---------------------------------------------------------------

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

// --- subcommand: check (CPU) ------------------------------------------------------------

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
                    + pytrt_kv::plugin::dataTypeName(idx) + " indices accepted (refused pos "
                    + std::to_string(refused) + ")");
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
        expect(ok && out.size() == 4 && out[0].type == t && out[1].type == t && out[2].type == kI32
                && out[3].type == kI32,
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
            out = in.size() == 10 ? std::vector<T>{in[0], in[1], in[3], T{kI32, {in[2].dims[0]}}}
                                  : std::vector<T>{in[2], in[3]};
        }
        int32_t refused = -1;
        bool const all = formatsAccepted(p, in, out, TensorFormat::kLINEAR, &refused);
        expect(!all && refused == pos, what + " (refused at " + std::to_string(refused) + ", expected "
                + std::to_string(pos) + ")");
    };
    refusedAt(s.get(), scatterNd(DataType::kUINT8), 0, "ScatterPaKvCache: kUINT8 key refused");
    refusedAt(s.get(), scatterNd(DataType::kBOOL), 0, "ScatterPaKvCache: kBOOL key refused");
    refusedAt(s.get(), scatterNd(kF16, kF32), 4, "ScatterPaKvCache: float slot_mapping refused");
    {
        auto in = scatterNd();
        in[1].type = kBF;
        in[3].type = kBF;
        refusedAt(s.get(), in, 1, "ScatterPaKvCache: value dtype != key dtype refused outside nz");
        declaredOutputs(sz.get(), in, out);
        expect(formatsAccepted(sz.get(), in, out), "ScatterPaKvCache: value dtype != key dtype accepted in nz");
    }
    {
        auto in = scatterNd();
        in[2].type = kBF;
        refusedAt(s.get(), in, 2, "ScatterPaKvCache: key_cache dtype != key refused");
    }
    {
        auto in = scatterCompress(kF16, kI32, 6);
        in[6].type = kI64;
        refusedAt(s.get(), in, 6, "ScatterPaKvCache: mixed index dtypes refused");
    }
    refusedAt(sr.get(), scatterCompress(kI8, kI32, 6), 0, "ScatterPaKvCache: compress_mode rope refuses int8");
    {
        auto in = gatherBsnd();
        in[6].type = kBF;
        refusedAt(g.get(), in, 6, "GatherSelectionKvCache: full_kv_cache dtype != selection cache refused");
        auto in2 = gatherBsnd();
        in2[2].type = kI64;
        refusedAt(g.get(), in2, 2, "GatherSelectionKvCache: int64 block table refused (spec: int32)");
        refusedAt(g.get(), gatherBsnd(DataType::kUINT8), 0, "GatherSelectionKvCache: kUINT8 caches refused");
    }
    {
        auto in = scatterNd();
        declaredOutputs(s.get(), in, out);
        expect(!formatsAccepted(s.get(), in, out, TensorFormat::kCHW32),
            "ScatterPaKvCache: non-linear format refused");
        auto gi = gatherBsnd();
        declaredOutputs(g.get(), gi, out);
        expect(!formatsAccepted(g.get(), gi, out, TensorFormat::kHWC8), "GatherSelectionKvCache: non-linear refused");
    }
    // Unexpected input counts are refused, not indexed past.
    {
        auto in = scatterNd();
        in.pop_back();
        auto descs = dynamicDescs(in);
        expect(!buildOf(s.get())->supportsFormatCombination(0, descs.data(), 4, 2),
            "ScatterPaKvCache: 4 inputs refused");
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
            std::vector<int32_t> const natural = scatter ? std::vector<int32_t>{2, 3} : std::vector<int32_t>{0, 1, 3, -1};
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
                shapesOk = out[0].dims == c.inputs[2].dims && out[1].dims == c.inputs[3].dims;
            }
            else
            {
                shapesOk = out[0].dims == c.inputs[0].dims && out[1].dims == c.inputs[1].dims
                    && out[2].dims == c.inputs[3].dims && out[3].dims == std::vector<int64_t>{c.inputs[2].dims[0]};
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
            expectLoggedError([&] { return buildOf(p.get())->configurePlugin(din.data(), nbIn, dout.data(), nbOut) != 0; },
                c.needle, c.plugin + ": configurePlugin refuses '" + c.label + "'");
            auto rin = runtimeDescs(c.inputs);
            auto rout = runtimeDescs(out);
            expectLoggedError([&] { return runtimeOf(p.get())->onShapeChange(rin.data(), nbIn, rout.data(), nbOut) != 0; },
                c.needle, c.plugin + ": onShapeChange refuses '" + c.label + "'");
        }
    }
    // enqueue before the plugin learnt its input count fails with a status, no crash.
    Fields f;
    f.str("cache_layout", "nd");
    PluginPtr p = create("ScatterPaKvCache", f);
    if (p)
    {
        auto rin = runtimeDescs(scatterNd());
        auto rout = runtimeDescs({{kF16, {4, 16, 2, 8}}, {kF16, {4, 16, 2, 4}}});
        void const* ins[5] = {};
        void* outs[2] = {};
        expectLoggedError(
            [&] { return runtimeOf(p.get())->enqueue(rin.data(), rout.data(), ins, outs, nullptr, nullptr) != 0; },
            "onShapeChange", "ScatterPaKvCache: enqueue before onShapeChange returns an error");
        auto with = [](std::vector<T> ts, size_t i, T t) {
            ts[i] = t;
            return ts;
        };
        // enqueue uses what onShapeChange validated: after a refused onShapeChange, or with
        // other shapes than it accepted, it fails too.
        auto rinBad = runtimeDescs(with(scatterNd(), 4, {kI32, {4}}));
        expectLoggedError([&] { return runtimeOf(p.get())->onShapeChange(rinBad.data(), 5, rout.data(), 2) != 0; },
            "slot_mapping", "ScatterPaKvCache: onShapeChange refuses a bad slot_mapping");
        expectLoggedError(
            [&] { return runtimeOf(p.get())->enqueue(rin.data(), rout.data(), ins, outs, nullptr, nullptr) != 0; },
            "onShapeChange", "ScatterPaKvCache: enqueue after a refused onShapeChange returns an error");
        expect(runtimeOf(p.get())->onShapeChange(rin.data(), 5, rout.data(), 2) == 0,
            "ScatterPaKvCache: onShapeChange accepts scatter nd");
        auto rinOther = runtimeDescs(with(with(scatterNd(), 0, {kF16, {4, 2, 8}}), 4, {kI32, {4}}));
        expectLoggedError(
            [&] { return runtimeOf(p.get())->enqueue(rinOther.data(), rout.data(), ins, outs, nullptr, nullptr) != 0; },
            "onShapeChange accepted", "ScatterPaKvCache: enqueue with other shapes than onShapeChange's fails");
    }
    Fields none;
    PluginPtr g = create("GatherSelectionKvCache", none);
    if (g)
    {
        auto with = [](std::vector<T> ts, size_t i, T t) {
            ts[i] = t;
            return ts;
        };
        auto rin = runtimeDescs(gatherBsnd());
        auto rout = runtimeDescs({{kF16, {8, 64, 64}}, {kF16, {8, 64, 512}}, {kI32, {2, 2, 1, 5}}, {kI32, {4}}});
        void const* ins[10] = {};
        void* outs[4] = {};
        expectLoggedError(
            [&] { return runtimeOf(g.get())->enqueue(rin.data(), rout.data(), ins, outs, nullptr, nullptr) != 0; },
            "onShapeChange", "GatherSelectionKvCache: enqueue before onShapeChange returns an error");
        auto rinBad = runtimeDescs(with(gatherBsnd(), 2, {kI32, {3, 4}}));
        expectLoggedError([&] { return runtimeOf(g.get())->onShapeChange(rinBad.data(), 10, rout.data(), 4) != 0; },
            "R >= B*S*H", "GatherSelectionKvCache: onShapeChange refuses R < B*S");
        expectLoggedError(
            [&] { return runtimeOf(g.get())->enqueue(rin.data(), rout.data(), ins, outs, nullptr, nullptr) != 0; },
            "onShapeChange", "GatherSelectionKvCache: enqueue after a refused onShapeChange returns an error");
        expect(runtimeOf(g.get())->onShapeChange(rin.data(), 10, rout.data(), 4) == 0,
            "GatherSelectionKvCache: onShapeChange accepts gather BSND");
        expectLoggedError(
            [&] { return runtimeOf(g.get())->enqueue(rinBad.data(), rout.data(), ins, outs, nullptr, nullptr) != 0; },
            "onShapeChange accepted", "GatherSelectionKvCache: enqueue with other shapes than onShapeChange's fails");
        // Workspace: the kernels' size for B*S*K plan entries = the topk volume, BSND and
        // TND alike (B=2, S=2, K=32: 128 entries, not B*T*K for TND).
        Fields tbs1;
        tbs1.i32("selection_topk_block_size", 1);
        PluginPtr g1 = create("GatherSelectionKvCache", tbs1);
        for (bool tnd : {false, true})
        {
            auto v = gatherBsnd();
            v[3] = tnd ? T{kI32, {4, 1, 33}} : T{kI32, {2, 2, 1, 33}};
            v[4] = tnd ? T{kI32, {4, 1, 32}} : T{kI32, {2, 2, 1, 32}};
            std::vector<T> out;
            bool const declared = g1 && declaredOutputs(g1.get(), v, out);
            auto din = dynamicDescs(v);
            auto dout = dynamicDescs(out);
            expect(declared && buildOf(g1.get())->getWorkspaceSize(din.data(), 10, dout.data(), 4)
                        == pytrt_kv::kernels::getGatherPlanWorkspaceSize(2 * 2 * 32),
                std::string("GatherSelectionKvCache: workspace of B*S*K plan entries for ") + (tnd ? "TND" : "BSND"));
        }
    }
}

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

// --- subcommand: run (GPU) -------------------------------------------------------------

#define HARNESS_CUDA(call)                                                                                             \
    do                                                                                                                 \
    {                                                                                                                  \
        cudaError_t const e_ = (call);                                                                                 \
        if (e_ != cudaSuccess)                                                                                         \
        {                                                                                                              \
            throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorName(e_));                              \
        }                                                                                                              \
    } while (0)

struct Buffer
{
    void* base{nullptr};   //!< what to free
    void* device{nullptr}; //!< what the plugin sees
    bool host{false};
    size_t bytes{0};
    ~Buffer()
    {
        if (base != nullptr)
        {
            host ? cudaFreeHost(base) : cudaFree(base);
        }
    }
};

std::unique_ptr<Buffer> allocate(size_t bytes, bool host)
{
    auto b = std::make_unique<Buffer>();
    b->bytes = bytes;
    b->host = host;
    size_t const n = bytes == 0 ? 1 : bytes; // zero-element tensors still get a valid address
    if (host)
    {
        HARNESS_CUDA(cudaHostAlloc(&b->base, n, cudaHostAllocMapped));
        HARNESS_CUDA(cudaHostGetDevicePointer(&b->device, b->base, 0));
    }
    else
    {
        HARNESS_CUDA(cudaMalloc(&b->base, n));
        b->device = b->base;
    }
    return b;
}

std::vector<uint8_t> download(Buffer const& b)
{
    std::vector<uint8_t> out(b.bytes);
    if (b.bytes != 0)
    {
        HARNESS_CUDA(cudaMemcpy(out.data(), b.device, b.bytes, cudaMemcpyDefault));
    }
    return out;
}

std::string firstDifference(std::vector<uint8_t> const& got, std::vector<uint8_t> const& want)
{
    if (got.size() != want.size())
    {
        return "size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
    }
    for (size_t i = 0; i < got.size(); ++i)
    {
        if (got[i] != want[i])
        {
            return "first differing byte " + std::to_string(i) + ": got " + std::to_string(got[i]) + ", want "
                + std::to_string(want[i]);
        }
    }
    return "";
}

//! Everything up to onShapeChange runs on the CPU; \p gpu adds enqueue on buffers.
void runCase(std::string const& dir, bool gpu)
{
    using namespace pytrt_kv::harness;
    Case c = loadCase(dir);
    std::string const label = c.plugin + " " + dir;
    IPluginCreatorV3One* creator = findCreator(c.plugin);
    expect(creator != nullptr, label + ": creator");
    if (creator == nullptr)
    {
        return;
    }
    Fields f;
    for (auto const& fld : c.fields)
    {
        fld.isInt ? f.i32(fld.name.c_str(), fld.intValue) : f.str(fld.name.c_str(), fld.text);
    }
    PluginPtr built = create(c.plugin, f);
    expect(built != nullptr, label + ": build-phase plugin");
    if (!built)
    {
        return;
    }
    std::vector<T> in;
    for (auto const& t : c.inputs)
    {
        in.push_back({t.type, std::vector<int64_t>(t.dims.d, t.dims.d + t.dims.nbDims)});
    }
    std::vector<T> out;
    expect(declaredOutputs(built.get(), in, out) && out.size() == c.outputs.size(), label + ": outputs declared");
    for (size_t o = 0; o < out.size() && o < c.outputs.size(); ++o)
    {
        std::vector<int64_t> want(c.outputs[o].dims.d, c.outputs[o].dims.d + c.outputs[o].dims.nbDims);
        expect(out[o].type == c.outputs[o].type && out[o].dims == want,
            label + ": output " + c.outputs[o].name + " type/shape as the reference");
    }
    auto din = dynamicDescs(in);
    auto dout = dynamicDescs(out);
    int32_t const nbIn = static_cast<int32_t>(in.size());
    int32_t const nbOut = static_cast<int32_t>(out.size());
    expect(formatsAccepted(built.get(), in, out), label + ": formats");
    expect(buildOf(built.get())->configurePlugin(din.data(), nbIn, dout.data(), nbOut) == 0, label + ": configure");
    size_t const workspace = buildOf(built.get())->getWorkspaceSize(din.data(), nbIn, dout.data(), nbOut);

    // The alias map, whatever alias_io the case uses (the copy path is tested with it).
    Fields aliasOn;
    aliasOn.i32("alias_io", 1);
    if (c.plugin == "ScatterPaKvCache")
    {
        for (auto const& fld : c.fields)
        {
            if (!fld.isInt)
            {
                aliasOn.str(fld.name.c_str(), fld.text);
            }
        }
    }
    PluginPtr aliasProbe = create(c.plugin, aliasOn);
    std::vector<int32_t> alias(nbOut, -1);
    for (int32_t o = 0; aliasProbe && o < nbOut; ++o)
    {
        alias[o] = buildOf(aliasProbe.get())->getAliasedInput(o);
    }

    PluginPtr runtime(creator->createPlugin(
        c.plugin.c_str(), runtimeOf(built.get())->getFieldsToSerialize(), TensorRTPhase::kRUNTIME));
    expect(runtime != nullptr, label + ": runtime-phase plugin from the serialized fields");
    if (!runtime)
    {
        return;
    }
    PluginPtr context(runtimeOf(runtime.get())->attachToContext(nullptr));
    auto rin = runtimeDescs(in);
    auto rout = runtimeDescs(out);
    expect(runtimeOf(context.get())->onShapeChange(rin.data(), nbIn, rout.data(), nbOut) == 0,
        label + ": onShapeChange");
    if (!gpu)
    {
        return;
    }

    cudaStream_t stream{};
    HARNESS_CUDA(cudaStreamCreate(&stream));
    for (bool inPlace : {true, false})
    {
        std::string const mode = inPlace ? " [in place]" : " [separate outputs]";
        std::vector<std::unique_ptr<Buffer>> inBufs;
        std::vector<void const*> inPtrs;
        for (auto const& t : c.inputs)
        {
            inBufs.push_back(allocate(t.bytes.size(), t.host));
            if (!t.bytes.empty())
            {
                HARNESS_CUDA(cudaMemcpy(inBufs.back()->device, t.bytes.data(), t.bytes.size(), cudaMemcpyDefault));
            }
            inPtrs.push_back(inBufs.back()->device);
        }
        std::vector<std::unique_ptr<Buffer>> outBufs;
        std::vector<void*> outPtrs;
        for (int32_t o = 0; o < nbOut; ++o)
        {
            if (inPlace && alias[o] >= 0)
            {
                outBufs.push_back(nullptr);
                outPtrs.push_back(inBufs[alias[o]]->device);
                continue;
            }
            // Garbage, so that a missing input->output copy cannot go unnoticed.
            outBufs.push_back(allocate(c.outputs[o].bytes.size(), false));
            HARNESS_CUDA(cudaMemset(outBufs.back()->device, 0xA5, outBufs.back()->bytes));
            outPtrs.push_back(outBufs.back()->device);
        }
        auto ws = allocate(workspace, false);
        int32_t const rc = runtimeOf(context.get())->enqueue(
            rin.data(), rout.data(), inPtrs.data(), outPtrs.data(), workspace ? ws->device : nullptr, stream);
        expect(rc == 0, label + mode + ": enqueue returned 0");
        HARNESS_CUDA(cudaStreamSynchronize(stream));
        HARNESS_CUDA(cudaGetLastError());
        for (int32_t o = 0; o < nbOut; ++o)
        {
            Buffer const& b = (inPlace && alias[o] >= 0) ? *inBufs[alias[o]] : *outBufs[o];
            std::string const diff = firstDifference(download(b), c.outputs[o].bytes);
            expect(diff.empty(), label + mode + ": " + c.outputs[o].name + " bit-exact vs reference " + diff);
        }
        for (int32_t i = 0; i < nbIn; ++i)
        {
            bool aliasedHere = false;
            for (int32_t o = 0; o < nbOut; ++o)
            {
                aliasedHere = aliasedHere || (inPlace && alias[o] == i);
            }
            if (!aliasedHere)
            {
                std::string const diff = firstDifference(download(*inBufs[i]), c.inputs[i].bytes);
                expect(diff.empty(), label + mode + ": input " + c.inputs[i].name + " unchanged " + diff);
            }
        }
    }
    HARNESS_CUDA(cudaStreamDestroy(stream));
}

int32_t commandRun(int argc, char** argv, bool gpu)
{
    int32_t devices = 0;
    if (gpu && (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0))
    {
        std::cerr << "harness run: no CUDA device\n";
        return 2;
    }
    for (int i = 2; i < argc; ++i)
    {
        try
        {
            runCase(argv[i], gpu);
        }
        catch (std::exception const& e)
        {
            expect(false, std::string(argv[i]) + ": " + e.what());
        }
    }
    std::cout << "harness " << (gpu ? "run" : "cases") << ": " << argc - 2 << " cases, " << gChecks << " checks, " << gFailures << " failed\n";
    return gFailures == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv)
{
    setLoggerFinder(&gFinder);
    std::string const cmd = argc > 1 ? argv[1] : "";
    // Refusals are expected during `check`; `run` shows everything the plugins log.
    gLogger.mEcho = cmd == "run" || std::getenv("PYTRT_KV_HARNESS_VERBOSE") != nullptr;
    try
    {
        if (cmd == "fields")
        {
            return commandFields();
        }
        if (cmd == "check")
        {
            return commandCheck();
        }
        if ((cmd == "run" || cmd == "cases") && argc > 2)
        {
            return commandRun(argc, argv, cmd == "run");
        }
    }
    catch (std::exception const& e)
    {
        std::cerr << "harness: " << e.what() << "\n";
        return 2;
    }
    std::cerr << "usage: " << (argc > 0 ? argv[0] : "pytrt_kv_plugin_harness")
              << " fields | check | cases CASE_DIR... | run CASE_DIR...\n";
    return 2;
}
