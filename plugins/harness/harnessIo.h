/*
 * Plugin harness I/O: the trivial case format that Python writes (plugins/harness/
 * makeCases.py) and the harness reads, so that GPU checks compare against
 * pytrt_kv.reference outputs without any serialization library.
 *
 * A case is a folder with case.txt, one record per line, fields separated by spaces:
 *   plugin <name>
 *   field <name> i <integer>            (passed as kINT32, as the ONNX parser does)
 *   field <name> s <text or ->          ("-" is the empty string; passed as kCHAR)
 *   input <name> <dtype> <rank> <d0> ... <file> [host]
 *   output <name> <dtype> <rank> <d0> ... <file>
 * dtypes use pytrt_kv/specs.py names; files hold the raw little-endian C-order bytes.
 * "host" places that input in pinned, mapped host memory (a host-resident full cache).
 */
#pragma once

#include "NvInferRuntime.h"

#include <cstdint>
#include <string>
#include <vector>

namespace pytrt_kv
{
namespace harness
{

struct TensorFile
{
    std::string name;
    nvinfer1::DataType type{nvinfer1::DataType::kFLOAT};
    nvinfer1::Dims dims{};
    std::string file;
    bool host{false};
    std::vector<uint8_t> bytes;
};

struct CaseField
{
    std::string name;
    bool isInt{false};
    int32_t intValue{0};
    std::string text;
};

struct Case
{
    std::string dir;
    std::string plugin;
    std::vector<CaseField> fields;
    std::vector<TensorFile> inputs;
    std::vector<TensorFile> outputs;
};

//! Parses dir/case.txt and loads every file; throws std::runtime_error naming the line.
Case loadCase(std::string const& dir);

//! specs.py dtype name -> TensorRT type; false for a name TensorRT cannot express.
bool dataTypeFromName(std::string const& name, nvinfer1::DataType& out);

//! Bytes of one element of \p type (0 when unknown).
int32_t elementSize(nvinfer1::DataType type);

} // namespace harness
} // namespace pytrt_kv
