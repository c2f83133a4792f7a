/*
 * What TensorRT provides a plugin, without libnvinfer: a logger that records errors, a
 * constant-only IExprBuilder (the builder's role in getOutputShapes) and tensor
 * descriptions made from {type, dims} pairs.
 */
#pragma once

#include "NvInferRuntime.h"

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace pytrt_kv
{
namespace harness
{

// --- logging: what the plugins send to "TensorRT's" logger ------------------------------

class CaptureLogger : public nvinfer1::ILogger
{
public:
    void log(Severity severity, nvinfer1::AsciiChar const* msg) noexcept override
    {
        if (severity <= Severity::kERROR)
        {
            ++mErrors;
            mLast = msg;
        }
        if (mEcho)
        {
            echo(msg);
        }
    }
    //! Errors logged so far, the last one's text, and whether to print every message.
    int32_t mErrors{0};
    std::string mLast;
    bool mEcho{false};

private:
    static void echo(nvinfer1::AsciiChar const* msg);
};

//! The logger every plugin message goes to (getLogger() finds it through gFinder).
extern CaptureLogger gLogger;

class Finder : public nvinfer1::ILoggerFinder
{
public:
    nvinfer1::ILogger* findLogger() noexcept override;
    ~Finder() override = default;
};

//! Passed to the plugin library's setLoggerFinder().
extern Finder gFinder;

// --- constant-only dimension expressions (the builder's role in getOutputShapes) --------

class ConstExprImpl : public nvinfer1::apiv::VDimensionExpr
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

class ConstExpr : public nvinfer1::IDimensionExpr
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

class ExprBuilderImpl : public nvinfer1::apiv::VExprBuilder
{
public:
    nvinfer1::IDimensionExpr const* constant(int64_t value) override
    {
        mExprs.push_back(std::make_unique<ConstExpr>(value));
        return mExprs.back().get();
    }
    nvinfer1::IDimensionExpr const* operation(
        nvinfer1::DimensionOperation op, nvinfer1::IDimensionExpr const& a, nvinfer1::IDimensionExpr const& b) override
    {
        int64_t const x = a.getConstantValue();
        int64_t const y = b.getConstantValue();
        switch (op)
        {
        case nvinfer1::DimensionOperation::kSUM: return constant(x + y);
        case nvinfer1::DimensionOperation::kPROD: return constant(x * y);
        case nvinfer1::DimensionOperation::kMAX: return constant(x > y ? x : y);
        case nvinfer1::DimensionOperation::kMIN: return constant(x < y ? x : y);
        case nvinfer1::DimensionOperation::kSUB: return constant(x - y);
        case nvinfer1::DimensionOperation::kEQUAL: return constant(x == y);
        case nvinfer1::DimensionOperation::kLESS: return constant(x < y);
        case nvinfer1::DimensionOperation::kFLOOR_DIV: return y == 0 ? nullptr : constant(x / y);
        case nvinfer1::DimensionOperation::kCEIL_DIV: return y == 0 ? nullptr : constant((x + y - 1) / y);
        }
        return nullptr;
    }
    nvinfer1::IDimensionExpr const* declareSizeTensor(
        int32_t, nvinfer1::IDimensionExpr const&, nvinfer1::IDimensionExpr const&) override
    {
        return nullptr;
    }

private:
    std::deque<std::unique_ptr<ConstExpr>> mExprs;
};

class ExprBuilder : public nvinfer1::IExprBuilder
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

//! One tensor as a case describes it: type and dims (-1: a build-time wildcard).
struct T
{
    nvinfer1::DataType type;
    std::vector<int64_t> dims;
};

nvinfer1::Dims makeDims(std::vector<int64_t> const& v);

//! Build-phase descriptions; a wildcard's profile range is [64, 64].
std::vector<nvinfer1::DynamicPluginTensorDesc> dynamicDescs(
    std::vector<T> const& ts, nvinfer1::TensorFormat format = nvinfer1::TensorFormat::kLINEAR);

//! Runtime-phase descriptions (linear format).
std::vector<nvinfer1::PluginTensorDesc> runtimeDescs(std::vector<T> const& ts);

//! Whether any dim of \p ts is a wildcard.
bool hasWildcard(std::vector<T> const& ts);

} // namespace harness
} // namespace pytrt_kv
