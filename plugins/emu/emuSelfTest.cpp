/*
 * Deliberately broken runs of the real gather kernels on the emulated device, one per check
 * it claims (docs/EMULATION.md, "Known to catch"): each mode must be REPORTED, so a test
 * that runs them proves the check works in that build.
 *
 *   pytrt_kv_emu_selftest ok         a valid gather: exit 0
 *   pytrt_kv_emu_selftest illegal    the selection cache is smaller than its declared shape:
 *                                    the copy kernel's stores leave the allocation, the
 *                                    emulator reports cudaErrorIllegalAddress (any build)
 *   pytrt_kv_emu_selftest store1     actual_seq one element short: the plan kernel's plain
 *                                    store of the last row's total is reported at its line
 *   pytrt_kv_emu_selftest load1      full_kv_actual_seq one element short: the plan kernel's
 *                                    plain load of the last row's length, at its line
 *   pytrt_kv_emu_selftest intrinsic1 the selection cache one element short: the copy
 *                                    kernel's last vector store (__stwb), at its line
 *   pytrt_kv_emu_selftest raw_device a kernel storing one byte past a 13-byte cudaMalloc
 *   pytrt_kv_emu_selftest raw_pinned ... and past a 13-byte cudaHostAlloc, with a raw store
 *                                    the emulator does not check: ASan reports (exact sizes)
 *   pytrt_kv_emu_selftest race       the plan kernel with its barrier after planLoad removed:
 *                                    threads read shared memory others write (TSan reports)
 *   pytrt_kv_emu_selftest streams    two streams write one buffer with nothing ordering
 *                                    them (TSan reports a race between the two kernels)
 *   pytrt_kv_emu_selftest ordered    the same two kernels with the first stream synchronized
 *                                    in between: no report (exit 0)
 *   pytrt_kv_emu_selftest ub         a kernel shifting by 32 (UBSan reports)
 *
 * The kernel source is the unchanged gatherSelectionKvCache.cu, included here after a macro
 * that lets one __syncthreads() call be skipped ("race" only).
 */
#include "pytrtKvEmu.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace
{
bool gSkipBarrier = false;
int gBarrierCalls[1024];

//! Barriers gatherPlanKernel passes per thread (the "ok" mode checks the count): before planLoad, after it, after
//! planPin, two in the block scan, after planFree.
constexpr int kPLAN_BARRIERS = 6;

//! __syncthreads() of the included kernels: with gSkipBarrier, each thread skips its
//! second barrier of every block (the one between planLoad and planPin).
void injectedSyncthreads()
{
    int& n = gBarrierCalls[threadIdx.x];
    int const call = n++;
    if (gSkipBarrier && call % kPLAN_BARRIERS == 1)
    {
        return;
    }
    ::pytrt_kv::emu::syncthreads();
}
} // namespace

#define __syncthreads() injectedSyncthreads()
#include "../kernels/gatherSelectionKvCache.cu"
#undef __syncthreads

namespace
{
using pytrt_kv::kernels::DataType;
using pytrt_kv::kernels::GatherSelectionParams;

__global__ void shiftKernel(int* out, int bits)
{
    out[threadIdx.x] = 1 << (bits + static_cast<int>(threadIdx.x)); // bits + tid >= 32 is UB
}

template <typename T>
T* upload(std::vector<T> const& host, size_t allocElems)
{
    void* p = nullptr;
    if (cudaMalloc(&p, allocElems * sizeof(T)) != cudaSuccess)
    {
        std::fprintf(stderr, "selftest: cudaMalloc failed\n");
        std::exit(2);
    }
    cudaMemcpy(p, host.data(), std::min(host.size(), allocElems) * sizeof(T), cudaMemcpyDefault);
    return static_cast<T*>(p);
}

int runGather(std::string const& mode)
{
    // B = 4 rows of K = 64 ids each, TBS 1, blocks of 16 tokens, 32-element int16 rows.
    int32_t const B = 4, K = 64, SBS = 16, FBS = 16, KV = 32;
    int32_t const sMax = K / SBS, fMax = 16;
    int64_t const sBlocks = B * sMax, fBlocks = B * fMax;
    std::mt19937 rng(7);
    std::vector<uint16_t> full(static_cast<size_t>(fBlocks * FBS * KV));
    for (auto& x : full)
    {
        x = static_cast<uint16_t>(rng());
    }
    std::vector<uint16_t> sel(static_cast<size_t>(sBlocks * SBS * KV), 0xA5A5);
    std::vector<int32_t> selTable(static_cast<size_t>(B * sMax)), fullTable(static_cast<size_t>(B * fMax));
    for (size_t i = 0; i < selTable.size(); ++i)
    {
        selTable[i] = static_cast<int32_t>(i);
    }
    for (size_t i = 0; i < fullTable.size(); ++i)
    {
        fullTable[i] = static_cast<int32_t>(i);
    }
    std::vector<int32_t> status(static_cast<size_t>(B * (K + 1)), -1), topk(static_cast<size_t>(B * K));
    for (int32_t r = 0; r < B; ++r)
    {
        status[static_cast<size_t>(r * (K + 1) + K)] = 0;
        for (int32_t k = 0; k < K; ++k)
        {
            topk[static_cast<size_t>(r * K + k)] = static_cast<int32_t>((k * 3 + r) % (fMax * FBS - 1));
        }
    }
    std::vector<int32_t> kvLen(B, fMax * FBS), actual(B, 0);

    GatherSelectionParams p{};
    // "illegal": room for one selection block only; "...1": one element short.
    size_t const selElems
        = mode == "illegal" ? static_cast<size_t>(SBS * KV) : sel.size() - (mode == "intrinsic1" ? 1 : 0);
    p.selectionKvCache = upload(sel, selElems);
    p.selectionKvBlockTable = upload(selTable, selTable.size());
    p.selectionKvBlockStatus = upload(status, status.size());
    p.selectionTopkIndices = upload(topk, topk.size());
    p.fullKvCache = upload(full, full.size());
    p.fullKvBlockTable = upload(fullTable, fullTable.size());
    p.fullKvActualSeq = upload(kvLen, kvLen.size() - (mode == "load1" ? 1 : 0));
    p.selectionKvActualSeq = upload(actual, actual.size() - (mode == "store1" ? 1 : 0));
    p.cacheType = DataType::kFLOAT16;
    p.batch = B;
    p.seqPerBatch = 1;
    p.topk = K;
    p.topkBlockSize = 1;
    p.selectionRows = B;
    p.selectionBlockNum = sBlocks;
    p.selectionBlockSize = SBS;
    p.selectionMaxBlockNum = sMax;
    p.fullBlockNum = fBlocks;
    p.fullBlockSize = FBS;
    p.fullMaxBlockNum = fMax;
    p.kvDim = KV;
    size_t const ws = pytrt_kv::kernels::getGatherSelectionWorkspaceSize(p);
    cudaMalloc(&p.workspace, ws);
    p.workspaceBytes = ws;
    gSkipBarrier = mode == "race";
    std::memset(gBarrierCalls, 0, sizeof(gBarrierCalls));
    cudaError_t e = pytrt_kv::kernels::launchGatherSelectionKvCache(p, nullptr);
    if (e == cudaSuccess)
    {
        e = cudaStreamSynchronize(nullptr);
    }
    std::printf("selftest %s: %s\n", mode.c_str(), cudaGetErrorName(e));
    if (e == cudaSuccess && mode == "ok" && (gBarrierCalls[0] == 0 || gBarrierCalls[0] % kPLAN_BARRIERS != 0))
    {
        // The race mode skips barrier 1 of every kPLAN_BARRIERS: a kernel with another count
        // would skip the wrong ones.
        std::printf(
            "selftest ok: thread 0 passed %d barriers, not a multiple of %d\n", gBarrierCalls[0], kPLAN_BARRIERS);
        return 1;
    }
    return e == cudaSuccess ? 0 : 1;
}

//! One byte past the allocation, by a plain store the emulator does not check (not
//! storeGlobal): only AddressSanitizer can see it, since allocations have their exact size.
__global__ void rawStoreKernel(unsigned char* p, int n)
{
    p[n] = 1; // the overflow
}

int runRaw(bool pinned)
{
    int const n = 13;
    void* p = nullptr;
    cudaError_t e = pinned ? cudaHostAlloc(&p, n, cudaHostAllocDefault) : cudaMalloc(&p, n);
    if (e == cudaSuccess)
    {
        PYTRT_KV_LAUNCH("rawStoreKernel", rawStoreKernel, 1, 1, nullptr, static_cast<unsigned char*>(p), n);
        e = cudaDeviceSynchronize();
    }
    std::printf("selftest raw_%s: %s\n", pinned ? "pinned" : "device", cudaGetErrorName(e));
    return e == cudaSuccess ? 0 : 1;
}

__global__ void fillKernel(int* p, int v)
{
    p[threadIdx.x] = v;
}

//! Two streams write one buffer: unordered ("streams") or ordered by a synchronize.
int runStreams(bool ordered)
{
    int* p = nullptr;
    cudaStream_t s1 = nullptr;
    cudaStream_t s2 = nullptr;
    cudaMalloc(reinterpret_cast<void**>(&p), 64 * sizeof(int));
    cudaStreamCreate(&s1);
    cudaStreamCreate(&s2);
    PYTRT_KV_LAUNCH("fillKernel", fillKernel, 1, 64, s1, p, 1);
    if (ordered)
    {
        cudaStreamSynchronize(s1);
    }
    PYTRT_KV_LAUNCH("fillKernel", fillKernel, 1, 64, s2, p, 2);
    cudaError_t const e = cudaDeviceSynchronize();
    int host[64];
    cudaMemcpy(host, p, sizeof(host), cudaMemcpyDeviceToHost);
    std::printf("selftest %s: %s, p[0] = %d\n", ordered ? "ordered" : "streams", cudaGetErrorName(e), host[0]);
    cudaStreamDestroy(s1);
    cudaStreamDestroy(s2);
    cudaFree(p);
    return e == cudaSuccess ? 0 : 1;
}

int runUb()
{
    int* out = nullptr;
    cudaMalloc(reinterpret_cast<void**>(&out), 64 * sizeof(int));
    PYTRT_KV_LAUNCH("shiftKernel", shiftKernel, 1, 64, nullptr, out, 0);
    cudaError_t const e = cudaStreamSynchronize(nullptr);
    std::printf("selftest ub: %s\n", cudaGetErrorName(e));
    return e == cudaSuccess ? 0 : 1;
}
} // namespace

int main(int argc, char** argv)
{
    std::string const mode = argc > 1 ? argv[1] : "";
    if (mode == "ok" || mode == "illegal" || mode == "store1" || mode == "load1" || mode == "intrinsic1"
        || mode == "race")
    {
        return runGather(mode);
    }
    if (mode == "raw_device" || mode == "raw_pinned")
    {
        return runRaw(mode == "raw_pinned");
    }
    if (mode == "streams" || mode == "ordered")
    {
        return runStreams(mode == "ordered");
    }
    if (mode == "ub")
    {
        return runUb();
    }
    std::fprintf(stderr,
        "usage: %s ok | illegal | store1 | load1 | intrinsic1 | raw_device | raw_pinned | race | streams | ordered "
        "| ub\n",
        argc > 0 ? argv[0] : "selftest");
    return 2;
}
