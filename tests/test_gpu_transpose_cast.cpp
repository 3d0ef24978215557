// CUDA transpose_2d and cast against the CPU reference, bit for bit.
// transpose_2d: every dtype width (1, 2, 4, 8 bytes), shapes around the 32 x 32 tile,
// degenerate ones, many tiles. cast: every pair of dtypes, on random bit patterns (NaN
// payloads, infinities, subnormals, rounding ties) for floating outputs and in-range
// values for integer outputs, plus the exact-integer cases (I32/I64 beyond 2^24) and
// misaligned F32 <-> BF16 (scalar path). Skipped (saying so) where no GPU is present.
#include <cmath>
#include <cstring>
#include <string>

#include "tessera/core/allocator.h"
#include "tessera/ops/elementwise.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// A CPU tensor of random bytes (every bit pattern of the dtype is possible).
Tensor random_bits(const Shape& shape, DType t, uint64_t seed) {
  Tensor out = Tensor::empty(shape, t);
  auto* p = static_cast<uint8_t*>(out.raw_data());
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < out.nbytes(); ++i) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    p[i] = static_cast<uint8_t>(s >> 24);
  }
  return out;
}

Tensor garbage_device(const Shape& shape, DType t) {
  Tensor host = random_bits(shape, t, 12345);  // garbage, whatever the dtype
  return host.to(kCuda);
}

// Element i of `a` and `b` (same dtype) agree when their bytes do, or when both are NaN:
// CPU and GPU conversions from F64 may carry different NaN payloads.
void expect_same_elements(const Tensor& got_device, const Tensor& want, const std::string& what) {
  const Tensor got = got_device.to(Device::cpu());
  const size_t es = dtype_size(want.dtype());
  const auto* g = static_cast<const uint8_t*>(got.raw_data());
  const auto* w = static_cast<const uint8_t*>(want.raw_data());
  int64_t bad = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    if (std::memcmp(g + i * es, w + i * es, es) == 0) continue;
    if (is_floating(want.dtype()) && std::isnan(got.item(i)) && std::isnan(want.item(i))) continue;
    if (bad++ < 5) ADD_FAILURE() << what << ": element " << i << " is " << got.item(i) << ", CPU " << want.item(i);
  }
  EXPECT_EQ(bad, 0) << what;
}

const DType kAll[] = {DType::F64, DType::F32, DType::F16, DType::BF16, DType::E4M3,
                      DType::E5M2, DType::E8M0, DType::I64, DType::I32, DType::U8};

// Input for a cast from `from` to `to`: any bits for floating outputs; for integer outputs
// finite values in [0, 200) (truncating out-of-range values is undefined in C++).
Tensor cast_input(DType from, DType to, int64_t n, uint64_t seed) {
  if (!is_integer(to)) return random_bits({n}, from, seed);
  Tensor out = Tensor::empty({n}, from);
  if (from == DType::E8M0) {  // powers of two 2^-7 .. 2^0
    for (int64_t i = 0; i < n; ++i) static_cast<uint8_t*>(out.raw_data())[i] = static_cast<uint8_t>(120 + i % 8);
    return out;
  }
  const Tensor values = random_tensor({n}, DType::F64, seed, 0.0f, 200.0f);
  for (int64_t i = 0; i < n; ++i)  // rounded into `from`; integers get whole numbers
    out.set_item(i, is_integer(from) ? std::floor(values.item(i)) : values.item(i));
  return out;
}

}  // namespace

TEST(GpuTranspose, MatchesTheCpuBitForBit) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 1100;
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},  {1, 37},  {33, 1},  {31, 65},    {64, 64},
                                               {257, 1000}, {0, 5}, {5, 0}, {3, 40000}, {2049, 33},
                                               // multiples of 16: 1-byte types take the 64 x 64 byte-tile kernel
                                               {16, 16}, {80, 48}, {64, 128}, {4096, 2064}};
  for (DType t : {DType::F64, DType::I64, DType::F32, DType::I32, DType::BF16, DType::F16, DType::E4M3,
                  DType::E5M2, DType::U8}) {
    for (auto [rows, cols] : shapes) {
      const std::string what =
          std::string(dtype_name(t)) + " [" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
      const Tensor in = random_bits({rows, cols}, t, seed++);
      Tensor want = Tensor::empty({cols, rows}, t);
      transpose_2d(cpu, in, want);
      Tensor got = garbage_device({cols, rows}, t);
      transpose_2d(gpu, in.to(kCuda), got);
      EXPECT_EQ(bytes_of(got), bytes_of(want)) << what;
    }
  }
}

TEST(GpuCast, EveryDtypePairMatchesTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 1200;
  const int64_t n = 4099;
  for (DType from : kAll) {
    for (DType to : kAll) {
      const std::string what = std::string(dtype_name(from)) + " -> " + dtype_name(to);
      const Tensor in = cast_input(from, to, n, seed++);
      Tensor want = Tensor::empty({n}, to);
      cast(cpu, in, want);
      Tensor got = garbage_device({n}, to);
      cast(gpu, in.to(kCuda), got);
      expect_same_elements(got, want, what);
    }
  }
}

TEST(GpuCast, RoundingTiesSpecialValuesAndLargeIntegers) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  // Halfway cases of BF16 (1 + 2^-8 ties to even), FP16, E4M3 (between 448 and the NaN
  // slot, and 464 = halfway to "480"), E5M2 (61440 halfway past the max), subnormals of
  // each format, and values around the saturation limits.
  const std::vector<float> specials = {1.00390625f, 1.01171875f, 1.0f + 1.0f / 2048, 448.0f,  464.0f,  480.0f,
                                       57344.0f,    61440.0f,    65520.0f,             -65520.0f, 1e-8f, 0.0009765625f,
                                       1.52587890625e-05f, 5.9604645e-08f, 2.98e-8f, -0.0f, INFINITY, -INFINITY,
                                       NAN,         3.4e38f,     1.17549435e-38f,      1.4e-45f};
  const Tensor f32 = Tensor::from_floats(specials, {static_cast<int64_t>(specials.size())});
  for (DType to : {DType::BF16, DType::F16, DType::E4M3, DType::E5M2, DType::F64, DType::E8M0}) {
    Tensor want = Tensor::empty(f32.shape(), to), got = garbage_device(f32.shape(), to);
    cast(cpu, f32, want);
    cast(gpu, f32.to(kCuda), got);
    expect_same_elements(got, want, std::string("specials f32 -> ") + dtype_name(to));
    // And back to F32 from those.
    Tensor back = Tensor::empty(f32.shape(), DType::F32), back_got = garbage_device(f32.shape(), DType::F32);
    cast(cpu, want, back);
    cast(gpu, want.to(kCuda), back_got);
    expect_same_elements(back_got, back, std::string("specials ") + dtype_name(to) + " -> f32");
  }
  // Integers beyond float's 24 bits keep their value where the CPU keeps it.
  const Tensor i64 = Tensor::from_ints({(int64_t{1} << 24) + 1, -((int64_t{1} << 31) - 1), (int64_t{1} << 53) + 1, 7},
                                       {4}, DType::I64);
  for (DType to : {DType::I64, DType::F64, DType::F32}) {
    Tensor want = Tensor::empty({4}, to), got = garbage_device({4}, to);
    cast(cpu, i64, want);
    cast(gpu, i64.to(kCuda), got);
    expect_same_elements(got, want, std::string("i64 -> ") + dtype_name(to));
  }
  const Tensor i32 = Tensor::from_ints({(1 << 24) + 1, -(1 << 30) - 3, 2147483647, -7}, {4}, DType::I32);
  for (DType to : {DType::I32, DType::I64, DType::F64}) {
    Tensor want = Tensor::empty({4}, to), got = garbage_device({4}, to);
    cast(cpu, i32, want);
    cast(gpu, i32.to(kCuda), got);
    expect_same_elements(got, want, std::string("i32 -> ") + dtype_name(to));
    EXPECT_EQ(got.to(Device::cpu()).item(0), double((1 << 24) + 1)) << dtype_name(to);
  }
}

TEST(GpuCast, MisalignedF32AndBf16) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const int64_t n = 1001;
  for (auto [from, to] : {std::pair{DType::F32, DType::BF16}, std::pair{DType::BF16, DType::F32}}) {
    const Tensor in = random_bits({n}, from, 1300);
    Tensor want = Tensor::empty({n}, to);
    cast(cpu, in, want);
    Tensor in_buffer = Tensor::empty({n + 1}, from, kCuda), out_buffer = garbage_device({n + 3}, to);
    Tensor in_view = in_buffer.slice(0, 1, n + 1), out_view = out_buffer.slice(0, 3, n + 3);
    in_view.copy_from(in);
    cast(gpu, in_view, out_view);
    expect_same_elements(out_view, want, std::string("misaligned ") + dtype_name(from) + " -> " + dtype_name(to));
  }
}
