/*
 * docs/SPEC.md S9, quantise on write: one float32 value (already divided by its scale) to a
 * float8 e4m3 (e4m3fn) or int8 cache element. Integer arithmetic only, so the GPU, the
 * emulated device and the host give the same bits; the NumPy reference
 * (pytrt_kv.reference.quantise) is the specification they are tested against.
 */
#pragma once

#include "kvHostDevice.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pytrt_kv
{
namespace kernels
{

//! Bits of a float32 (a memcpy: no aliasing rule broken on any compiler).
PYTRT_KV_HD uint32_t floatBits(float v)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(v);
#else
    uint32_t bits = 0;
    std::memcpy(&bits, &v, sizeof(bits));
    return bits;
#endif
}

//! Round-to-nearest-even of (m >> shift) for 1 <= shift <= 31.
PYTRT_KV_HD uint32_t shiftRoundEven(uint32_t m, int32_t shift)
{
    uint32_t const q = m >> shift;
    uint32_t const rem = m & ((1U << shift) - 1U);
    uint32_t const half = 1U << (shift - 1);
    return q + ((rem > half || (rem == half && (q & 1U) != 0U)) ? 1U : 0U);
}

//! The e4m3 NaN every NaN is written as (docs/SPEC.md S9): NVIDIA's canonical one.
constexpr uint8_t kE4M3_NAN = 0x7F;

//! \p v as GPU float arithmetic leaves it: NVIDIA's float instructions return the
//! canonical NaN (0x7FFFFFFF) for any NaN result, while a host CPU keeps an operand's sign
//! and payload. Applied to the results of the kernels' float arithmetic, so the emulated
//! device and the host path give the GPU's bits; on the GPU it is the identity.
PYTRT_KV_HD float asGpuResult(float v)
{
#if defined(__CUDA_ARCH__)
    return v;
#else
    if (v != v)
    {
        uint32_t const canonical = 0x7FFFFFFFU;
        std::memcpy(&v, &canonical, sizeof(v));
    }
    return v;
#endif
}

//! float8 e4m3fn bits of \p v, |v| <= 448 or NaN (the caller clamps): round to nearest
//! even, subnormals included; any NaN is kE4M3_NAN (as __nv_cvt_float_to_fp8 writes the
//! canonical NaN a GPU division gives); zero keeps its sign.
PYTRT_KV_HD uint8_t floatToE4m3(float v)
{
    uint32_t const bits = floatBits(v);
    uint32_t const sign = (bits >> 24) & 0x80U;
    uint32_t const a = bits & 0x7FFFFFFFU;
    if (a > 0x7F800000U)
    {
        return kE4M3_NAN;
    }
    if (a < 0x00800000U)
    {
        return static_cast<uint8_t>(sign); // zero or a float32 subnormal (< 2^-126): 0
    }
    int32_t const e = static_cast<int32_t>(a >> 23) - 127;
    uint32_t const mant = a & 0x7FFFFFU;
    if (e >= -6)
    {
        // Normal: 4-bit exponent (bias 7), 3-bit mantissa; a carry from rounding moves to
        // the next exponent, which is the right encoding (and 448 is the largest input).
        uint32_t const q = shiftRoundEven((static_cast<uint32_t>(e + 7) << 23) | mant, 20);
        return static_cast<uint8_t>(sign | q);
    }
    // Subnormal: q = round(|v| * 2^9) = round(M24 * 2^(e - 14)); q == 8 is 2^-6 (0x08).
    int32_t const shift = 14 - e; // >= 21
    if (shift > 25)
    {
        return static_cast<uint8_t>(sign); // |v| < 2^-11: below half the smallest step
    }
    return static_cast<uint8_t>(sign | shiftRoundEven(mant | 0x800000U, shift));
}

//! int8 of \p v, |v| <= 127 (the caller clamps): nearest integer, ties to even. NaN has no
//! int8 form: the contract refuses it (docs/SPEC.md S9), the kernels write 0.
PYTRT_KV_HD uint8_t floatToInt8(float v)
{
    if (v != v)
    {
        return 0;
    }
    return static_cast<uint8_t>(static_cast<int8_t>(static_cast<int32_t>(rintf(v))));
}

//! The two quantised cache types: M and the conversion.
struct QuantE4m3
{
    static constexpr float kMAX = 448.0F;
    static PYTRT_KV_HD uint8_t convert(float v)
    {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        // sm_89+: the hardware conversion (one instruction, round to nearest even, the
        // same bits as floatToE4m3 for every clamped input: tests/test_quantise.py runs
        // both against the reference on the GPU); NaN is written here, whatever its sign,
        // so that -NaN stays kE4M3_NAN (docs/SPEC.md S9).
        if (v != v)
        {
            return kE4M3_NAN;
        }
        uint16_t pair;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0F), "f"(v));
        return static_cast<uint8_t>(pair & 0xFFU);
#else
        return floatToE4m3(v);
#endif
    }
};

struct QuantInt8
{
    static constexpr float kMAX = 127.0F;
    static PYTRT_KV_HD uint8_t convert(float v)
    {
        return floatToInt8(v);
    }
};

//! q = convert(clamp(x / scale, -M, M)); NaN passes the clamp unchanged.
template <typename Q>
PYTRT_KV_HD uint8_t quantise(float x, float scale)
{
    float v = asGpuResult(x / scale);
    v = v > Q::kMAX ? Q::kMAX : (v < -Q::kMAX ? -Q::kMAX : v);
    return Q::convert(v);
}

} // namespace kernels
} // namespace pytrt_kv
