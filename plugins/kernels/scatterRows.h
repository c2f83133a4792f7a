/*
 * docs/SPEC.md S6 (compressing write): which source token each cache row of one (b, h) run
 * receives. Shared by the scatter kernel and the host test entry point
 * pytrt_kv_compress_rows_host(), so the CPU tests check exactly what the GPU runs.
 */
#pragma once

#include "kvHostDevice.h"
#include "scatterPaKvCache.h"

#include <cstdint>

namespace pytrt_kv
{
namespace kernels
{

//! Source of a row that receives nothing (row index past the run, or an invalid run).
constexpr int32_t kROW_NONE = -1;
//! Source of the "rope" mean row: mean(x_o .. x_{o+w-1}).
constexpr int32_t kROW_MEAN = -2;

//! One (b, h) run of docs/SPEC.md S6, with its raw index values. Values that break docs/SPEC.md's
//! constraints make an empty run (the kernels stay in bounds; the reference raises).
struct CompressRun
{
    int32_t rows{0};   //!< number of cache rows written: base .. base+rows-1
    int32_t offset{0}; //!< o (rope/omni, compressed runs)
    int32_t width{0};  //!< w
    int32_t seqLen{0}; //!< L
    bool compressed{false};
};

//! Plan the run of one (b, h): \p seqLen = seq_lens[b], \p width = compress_lens[b, h],
//! \p offset = compress_seq_offsets[b*H + h] (ignored by alibi), \p maxSeqLen = Smax.
PYTRT_KV_HD CompressRun compressRun(CompressMode mode, int64_t seqLen, int64_t width, int64_t offset, int64_t maxSeqLen)
{
    CompressRun run;
    // L > Smax would read past the padded key row: an invalid run writes nothing.
    if (seqLen < 0 || seqLen > maxSeqLen)
    {
        return run;
    }
    run.seqLen = static_cast<int32_t>(seqLen);
    if (mode == CompressMode::kALIBI)
    {
        if (0 <= width && width <= seqLen)
        {
            run.width = static_cast<int32_t>(width);
            run.rows = static_cast<int32_t>(width);
        }
        return run;
    }
    // An uncompressed head (o == -1, w == 0 or o == L) writes L rows whatever w is
    // (_scatter.py _run_rows; DECISIONS S3): w is only checked for a compressed head.
    run.compressed = !(offset == -1 || width == 0 || offset == seqLen);
    if (!run.compressed)
    {
        run.rows = static_cast<int32_t>(seqLen);
        return run;
    }
    // Written as width > L - o so that garbage int64 values cannot overflow.
    if (offset < 0 || width < 0 || width > seqLen - offset)
    {
        run.compressed = false;
        return run;
    }
    run.offset = static_cast<int32_t>(offset);
    run.width = static_cast<int32_t>(width);
    run.rows = static_cast<int32_t>(mode == CompressMode::kROPE ? seqLen - width + 1 : seqLen - width);
    return run;
}

//! Source token of row \p i of \p run: a token index in [0, L), kROW_MEAN or kROW_NONE.
PYTRT_KV_HD int32_t compressRowSource(CompressMode mode, CompressRun const& run, int32_t i)
{
    if (i < 0 || i >= run.rows)
    {
        return kROW_NONE;
    }
    if (mode == CompressMode::kALIBI)
    {
        return run.seqLen - run.width + i;
    }
    if (!run.compressed || i < run.offset)
    {
        return i;
    }
    if (mode == CompressMode::kROPE)
    {
        return i == run.offset ? kROW_MEAN : run.offset + run.width + (i - run.offset - 1);
    }
    return run.offset + run.width + (i - run.offset);
}

} // namespace kernels
} // namespace pytrt_kv
