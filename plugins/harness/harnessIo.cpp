/*
 * Plugin harness I/O (see harnessIo.h).
 */
#include "harnessIo.h"

#include "pluginCommon.h"

#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>

namespace pytrt_kv
{
namespace harness
{

bool dataTypeFromName(std::string const& name, nvinfer1::DataType& out)
{
    using nvinfer1::DataType;
    static std::pair<char const*, DataType> const kNAMES[]
        = {{"float32", DataType::kFLOAT}, {"float16", DataType::kHALF}, {"bfloat16", DataType::kBF16},
            {"int8", DataType::kINT8}, {"uint8", DataType::kUINT8}, {"float8_e4m3fn", DataType::kFP8},
            {"int32", DataType::kINT32}, {"int64", DataType::kINT64}};
    for (auto const& [n, t] : kNAMES)
    {
        if (name == n)
        {
            out = t;
            return true;
        }
    }
    return false;
}

int32_t elementSize(nvinfer1::DataType type)
{
    kernels::DataType k{};
    return plugin::toKernelType(type, k) ? kernels::dataTypeSize(k) : 0;
}

namespace
{

TensorFile parseTensor(std::istringstream& is, std::string const& dir, std::string const& where)
{
    TensorFile t;
    std::string dtype;
    int32_t rank{-1};
    is >> t.name >> dtype >> rank;
    if (!is || !dataTypeFromName(dtype, t.type) || rank < 0 || rank > nvinfer1::Dims::MAX_DIMS)
    {
        throw std::runtime_error(where + ": expected '<name> <dtype> <rank> <dims...> <file> [host]'");
    }
    t.dims.nbDims = rank;
    for (int32_t i = 0; i < rank; ++i)
    {
        is >> t.dims.d[i];
    }
    is >> t.file;
    std::string extra;
    if (is >> extra)
    {
        t.host = extra == "host";
        if (!t.host)
        {
            throw std::runtime_error(where + ": unexpected '" + extra + "'");
        }
    }
    if (t.file.empty())
    {
        throw std::runtime_error(where + ": missing file name");
    }
    std::ifstream f(dir + "/" + t.file, std::ios::binary);
    if (!f)
    {
        throw std::runtime_error(where + ": cannot open " + dir + "/" + t.file);
    }
    t.bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    int64_t const expected = plugin::volume(t.dims) * elementSize(t.type);
    if (static_cast<int64_t>(t.bytes.size()) != expected)
    {
        throw std::runtime_error(where + ": " + t.file + " has " + std::to_string(t.bytes.size())
            + " bytes, the shape needs " + std::to_string(expected));
    }
    return t;
}

} // namespace

Case loadCase(std::string const& dir)
{
    std::ifstream f(dir + "/case.txt");
    if (!f)
    {
        throw std::runtime_error("cannot open " + dir + "/case.txt");
    }
    Case c;
    c.dir = dir;
    std::string line;
    int32_t lineNo = 0;
    while (std::getline(f, line))
    {
        ++lineNo;
        std::string const where = dir + "/case.txt:" + std::to_string(lineNo);
        std::istringstream is(line);
        std::string kind;
        if (!(is >> kind) || kind[0] == '#')
        {
            continue;
        }
        if (kind == "plugin")
        {
            is >> c.plugin;
        }
        else if (kind == "field")
        {
            CaseField fld;
            std::string type;
            is >> fld.name >> type;
            if (type == "i")
            {
                fld.isInt = true;
                is >> fld.intValue;
            }
            else if (type == "s")
            {
                is >> fld.text;
                if (fld.text == "-")
                {
                    fld.text.clear();
                }
            }
            if (!is || (type != "i" && type != "s"))
            {
                throw std::runtime_error(where + ": expected 'field <name> i <int>' or 'field <name> s <text>'");
            }
            c.fields.push_back(fld);
        }
        else if (kind == "input")
        {
            c.inputs.push_back(parseTensor(is, dir, where));
        }
        else if (kind == "output")
        {
            c.outputs.push_back(parseTensor(is, dir, where));
        }
        else
        {
            throw std::runtime_error(where + ": unknown record '" + kind + "'");
        }
    }
    if (c.plugin.empty() || c.inputs.empty() || c.outputs.empty())
    {
        throw std::runtime_error(dir + "/case.txt: needs a plugin line, inputs and outputs");
    }
    return c;
}

} // namespace harness
} // namespace pytrt_kv
