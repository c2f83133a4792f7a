/*
 * fp16 / bf16 conversions of the emulated device (docs/EMULATION.md): bit-exact software
 * versions of __half2float, __float2half_rn, __bfloat162float and __float2bfloat16_rn,
 * rounding to nearest even, a NaN canonical (0x7FFF) as the GPU's cvt instructions write it.
 */
#include "emuInternal.h"

#include <cstring>

namespace pytrt_kv
{
namespace emu
{
namespace
{

//! The float whose IEEE-754 bits are \p bits, and back (std::bit_cast before C++20).
float floatOfBits(uint32_t bits) noexcept
{
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

uint32_t bitsOfFloat(float f) noexcept
{
    uint32_t x;
    std::memcpy(&x, &f, sizeof(x));
    return x;
}

} // namespace

float halfToFloat(unsigned short h) noexcept
{
    uint32_t const sign = static_cast<uint32_t>(h & 0x8000U) << 16;
    uint32_t const exp = (h >> 10) & 0x1FU;
    uint32_t mant = h & 0x3FFU;
    uint32_t bits = 0;
    if (exp == 0x1FU)
    {
        bits = sign | 0x7F800000U | (mant << 13);
    }
    else if (exp != 0)
    {
        bits = sign | ((exp + 112U) << 23) | (mant << 13);
    }
    else if (mant != 0)
    {
        int e = -1;
        do
        {
            ++e;
            mant <<= 1;
        } while ((mant & 0x400U) == 0);
        bits = sign | ((112U - static_cast<uint32_t>(e)) << 23) | ((mant & 0x3FFU) << 13);
    }
    else
    {
        bits = sign;
    }
    return floatOfBits(bits);
}

unsigned short floatToHalfRn(float f) noexcept
{
    uint32_t const x = bitsOfFloat(f);
    uint32_t const sign = (x >> 16) & 0x8000U;
    uint32_t const absx = x & 0x7FFFFFFFU;
    if (absx > 0x7F800000U)
    {
        return 0x7FFF; // NaN: canonical, as the GPU's cvt.rn.f16.f32
    }
    if (absx >= 0x477FF000U) // rounds to >= 65520: infinity
    {
        return static_cast<unsigned short>(sign | 0x7C00U);
    }
    if (absx < 0x33000000U) // < 2^-25: rounds to zero (2^-25 itself ties to even zero)
    {
        return static_cast<unsigned short>(sign);
    }
    int32_t const exp = static_cast<int32_t>(absx >> 23) - 127;
    uint32_t mant = (absx & 0x7FFFFFU) | 0x800000U;
    uint32_t shift = 0;
    uint32_t base = 0;
    if (exp < -14)
    {
        shift = static_cast<uint32_t>(13 + (-14 - exp)); // subnormal result
        base = 0;
    }
    else
    {
        shift = 13;
        base = static_cast<uint32_t>(exp + 15) << 10;
        mant &= 0x7FFFFFU;
    }
    uint32_t const kept = mant >> shift;
    uint32_t const rest = mant & ((1U << shift) - 1U);
    uint32_t const half = 1U << (shift - 1);
    uint32_t out = base + kept;
    if (rest > half || (rest == half && (kept & 1U)))
    {
        ++out; // may carry into the exponent, and into infinity: both correct
    }
    return static_cast<unsigned short>(sign | out);
}

float bf16ToFloat(unsigned short h) noexcept
{
    uint32_t const bits = static_cast<uint32_t>(h) << 16;
    return floatOfBits(bits);
}

unsigned short floatToBf16Rn(float f) noexcept
{
    uint32_t x = bitsOfFloat(f);
    if ((x & 0x7FFFFFFFU) > 0x7F800000U)
    {
        return 0x7FFF; // NaN: canonical, as the GPU's cvt.rn.bf16.f32
    }
    x += 0x7FFFU + ((x >> 16) & 1U);
    return static_cast<unsigned short>(x >> 16);
}

} // namespace emu
} // namespace pytrt_kv
