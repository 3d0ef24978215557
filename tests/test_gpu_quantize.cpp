// CUDA FP8 quantization against the CPU reference, byte for byte: amax, per-tensor,
// block (1x128, 128x128, odd tiles) and MXFP8 quantize and dequantize; every input dtype,
// both FP8 formats, partial edge blocks, zero tensors, values past the FP8 range, NaN of
// either sign, Inf, and misaligned (scalar-path) views. Each GPU output is poisoned with
// two different byte patterns in two runs, so an element the kernel forgets cannot match.
//
// The first tests check the kernels' bit-level helpers against numeric.h on the host and
// run without a GPU; the rest skip (saying so) where no GPU is present.
#include <cstring>
#include <functional>

#include "backend/cuda/quantize.h"
#include "gpu_testing.h"
#include "quantize_testing.h"
#include "tessera/core/allocator.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// ---- Host checks of the kernels' scalar helpers ---------------------------------------------

void expect_encoders_match(uint32_t bits) {
  const float x = bits_float(bits);
  ASSERT_EQ(cuda::encode_e4m3_bits(x), float_to_e4m3(x)) << std::hex << "float bits 0x" << bits;
  ASSERT_EQ(cuda::encode_e5m2_bits(x), float_to_e5m2(x)) << std::hex << "float bits 0x" << bits;
}

}  // namespace

TEST(GpuQuantizeBits, EncodersMatchNumericH) {
  // Every sign and exponent with the mantissas where rounding decides: 0, 1, all ones, and
  // one below, at and above the halfway points of both formats (2 and 3 mantissa bits).
  std::vector<uint32_t> mantissas = {0u, 1u, 0x7fffffu};
  for (int kept : {2, 3}) {
    const uint32_t half = 1u << (22 - kept);
    for (uint32_t top = 0; top < (1u << kept); ++top) {
      const uint32_t base = top << (23 - kept);
      for (uint32_t m : {base + half - 1, base + half, base + half + 1, base + 2 * half - 1})
        mantissas.push_back(m & 0x7fffffu);
    }
  }
  for (uint32_t sign : {0u, 0x80000000u})
    for (uint32_t e = 0; e < 256; ++e)
      for (uint32_t m : mantissas) expect_encoders_match(sign | (e << 23) | m);
  // And a sweep over all bit patterns with an odd stride.
  for (uint64_t b = 0; b <= 0xffffffffull; b += 65519) expect_encoders_match(static_cast<uint32_t>(b));
}

TEST(GpuQuantizeBits, DecodersMatchNumericHForEveryCode) {
  for (int c = 0; c < 256; ++c) {
    EXPECT_EQ(float_bits(cuda::decode_e4m3_bits(static_cast<uint8_t>(c))), float_bits(e4m3_to_float(c))) << c;
    EXPECT_EQ(float_bits(cuda::decode_e5m2_bits(static_cast<uint8_t>(c))), float_bits(e5m2_to_float(c))) << c;
  }
}

#if defined(__x86_64__) || defined(__i386__)
// On the x86 hosts the CPU reference runs on, mul_x86_nan is a plain product, NaN bits included.
TEST(GpuQuantizeBits, NanProductsAreX86s) {
  const float values[] = {2.0f, -3.0f, 0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, bits_float(0x7f800001u),
                          bits_float(0xff912345u)};
  for (float a : values)
    for (float b : values) {
      volatile float va = a, vb = b;
      if (std::isnan(a) && std::isnan(b)) continue;  // which NaN wins depends on the operand order the compiler picks
      EXPECT_EQ(float_bits(cuda::mul_x86_nan(a, b)), float_bits(va * vb)) << a << " * " << b;
    }
}
#endif

namespace {

// ---- GPU test helpers --------------------------------------------------------------------------

// A CPU tensor filled with one byte.
Tensor filled(const Shape& shape, DType dtype, uint8_t byte) {
  Tensor t = Tensor::empty(shape, dtype);
  if (t.nbytes() > 0) std::memset(t.raw_data(), byte, t.nbytes());
  return t;
}

// A GPU copy of `cpu`; misalign > 0 puts element 0 that many elements past an allocation's
// start, so that the kernels take their scalar (unaligned) paths.
Tensor on_gpu(const Tensor& cpu, int64_t misalign = 0) {
  const int64_t n = cpu.numel();
  Tensor base = Tensor::empty({n + misalign}, cpu.dtype(), Device::cuda());
  Tensor view = base.slice(0, misalign, misalign + n).reshape(cpu.shape());
  view.copy_from(cpu);
  return view;
}

Tensor to_cpu(const Tensor& t) { return t.to(Device::cpu()).contiguous(); }

std::string describe_case(const std::string& what, const Tensor& x, DType out, int64_t misalign) {
  return what + " " + x.describe() + " -> " + dtype_name(out) + (misalign ? " (misaligned)" : "");
}

// Byte-for-byte equality; reports the first differing element.
void expect_same_bytes(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  if (got.nbytes() == 0 || std::memcmp(got.raw_data(), want.raw_data(), got.nbytes()) == 0) return;
  const size_t size = dtype_size(got.dtype());
  const auto* g = static_cast<const uint8_t*>(got.raw_data());
  const auto* w = static_cast<const uint8_t*>(want.raw_data());
  int64_t first = -1, count = 0;
  for (int64_t i = 0; i < got.numel(); ++i)
    if (std::memcmp(g + i * size, w + i * size, size) != 0) {
      if (first < 0) first = i;
      ++count;
    }
  ADD_FAILURE() << what << ": " << count << " of " << got.numel() << " elements differ; first at " << first
                << ": got " << got.item(first) << ", want " << want.item(first);
}

bool code_is_nan(DType fp8, uint8_t c) { return std::isnan(fp8 == DType::E4M3 ? e4m3_to_float(c) : e5m2_to_float(c)); }

// The same bytes, except where both operands of the product are NaN (both_nan(i)): which
// NaN the CPU returns then depends on the operand order its compiler picks (see
// cuda::mul_x86_nan), so any NaN is accepted there.
void expect_same_but_nan_pairs(const Tensor& got, const Tensor& want, const std::string& what,
                             const std::function<bool(int64_t)>& both_nan) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const size_t size = dtype_size(got.dtype());
  const auto* g = static_cast<const uint8_t*>(got.raw_data());
  const auto* w = static_cast<const uint8_t*>(want.raw_data());
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (std::memcmp(g + i * size, w + i * size, size) == 0) continue;
    if (both_nan(i) && std::isnan(got.item(i)) && std::isnan(want.item(i))) continue;
    if (first < 0) first = i;
    ++bad;
  }
  EXPECT_EQ(bad, 0) << what << ": first difference at " << first << ": got " << got.item(first) << ", want "
                    << want.item(first);
}

// Inputs with everything the rules single out, where the shape has room: a zero first row
// and last column (zero blocks, and an all-zero bottom-right 128x128 edge tile for 130x257),
// NaN of both signs, both infinities, values far past the FP8 range, float subnormals.
Tensor special_input(int64_t rows, int64_t cols, DType dtype, uint64_t seed) {
  std::vector<float> v = wide_range_tensor(rows, cols, seed).to_floats();
  auto set = [&](int64_t r, int64_t c, float value) {
    if (r < rows && c >= 0 && c < cols) v[r * cols + c] = value;
  };
  if (rows >= 8 && cols >= 8) {
    for (int64_t c = 0; c < cols; ++c) set(0, c, 0.0f);
    for (int64_t r = 0; r < rows; ++r) set(r, cols - 1, 0.0f);
    set(1, 3, NAN);
    set(2, cols - 40, -NAN);
    set(3, 40, INFINITY);
    set(4, 100, -INFINITY);
    set(5, 7, 3e38f);
    set(5, 8, -1e5f);
    for (int64_t c = 0; c < cols - 1; ++c) set(6, c, (c % 3 - 1) * 1e-39f);  // subnormal row: scale FLT_MAX
    set(7, 2, -0.0f);
  }
  return Tensor::from_floats(v, {rows, cols}, dtype);
}

// FP8 codes running through every value (NaN codes included) in a seed-dependent order.
Tensor all_codes(int64_t rows, int64_t cols, DType fp8, uint64_t seed) {
  Tensor q = Tensor::empty({rows, cols}, fp8);
  auto* c = q.data<uint8_t>();
  for (int64_t i = 0; i < q.numel(); ++i) c[i] = static_cast<uint8_t>(i * 7 + seed + i / 256);
  return q;
}

const auto kNeverBothNan = [](int64_t) { return false; };

const DType kFp8[] = {DType::E4M3, DType::E5M2};
const uint8_t kPoison[] = {0x5A, 0xA5};

}  // namespace

// ---- amax ---------------------------------------------------------------------------------------

TEST(GpuQuantize, AmaxMatchesTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 100;
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F64, DType::E4M3, DType::E5M2}) {
    for (int64_t n : {0, 1, 15, 16, 17, 4099, 300001}) {
      for (int special = 0; special < 5; ++special) {
        Tensor x = random_tensor({n}, t, seed++, -300.0f, 300.0f);
        if (n > 0) {
          if (special == 1) x.set_item(n - 1, NAN);
          if (special == 2) x.set_item(n / 2, -NAN);
          if (special == 3) x.set_item(0, -INFINITY);
          if (special == 4) x = Tensor::zeros({n}, t);
        }
        for (int64_t misalign : {0, 1}) {
          const std::string what = describe_case("amax case " + std::to_string(special), x, DType::F32, misalign);
          Tensor want = filled({1}, DType::F32, 0x5A);
          amax(cpu, x, want);
          for (uint8_t p : kPoison) {
            Tensor got = on_gpu(filled({1}, DType::F32, p));
            amax(gpu, on_gpu(x, misalign), got);
            expect_same_bytes(to_cpu(got), want, what);
          }
        }
      }
    }
  }
}

// ---- Per-tensor scaling ---------------------------------------------------------------------------

TEST(GpuQuantize, PerTensorMatchesTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 200;
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F64, DType::E5M2}) {
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{130, 257}, {1, 1}, {1, 16}, {3, 33}, {64, 1024}}) {
      Tensor x = special_input(rows, cols, t, seed++);
      for (DType fp8 : kFp8) {
        // The current-scaling scale, a scale that pushes most values past the FP8 range, and 1.
        Tensor a = Tensor::empty({1}, DType::F32);
        amax(cpu, x, a);
        const float from_amax = fp8_scale_from_amax(static_cast<float>(a.item(0)), fp8);
        for (float s : {from_amax, 1e4f, 1.0f}) {
          for (int64_t misalign : {0, 3}) {
            const std::string what = describe_case("scale " + std::to_string(s), x, fp8, misalign);
            Tensor want = filled({rows, cols}, fp8, 0), want_amax = filled({1}, DType::F32, 0);
            quantize_per_tensor(cpu, x, scalar(s), want, want_amax);
            for (uint8_t p : kPoison) {
              Tensor got = on_gpu(filled({rows, cols}, fp8, p), misalign);
              Tensor got_amax = on_gpu(filled({1}, DType::F32, p));
              quantize_per_tensor(gpu, on_gpu(x, misalign), on_gpu(scalar(s)), got, got_amax);
              expect_same_bytes(to_cpu(got), want, what);
              expect_same_bytes(to_cpu(got_amax), want_amax, what + " amax");
              Tensor got_only = on_gpu(filled({rows, cols}, fp8, p), misalign);
              quantize_per_tensor(gpu, on_gpu(x, misalign), on_gpu(scalar(s)), got_only);
              expect_same_bytes(to_cpu(got_only), want, what + " (no amax)");
            }
          }
        }
      }
    }
  }
}

TEST(GpuQuantize, PerTensorOddScalesAndAliasedAmax) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  Tensor x = special_input(9, 300, DType::F32, 7);
  for (DType fp8 : kFp8) {
    // 0 * Inf and NaN scales make NaN products: the CPU's NaN sign must come through.
    for (float s : {0.0f, NAN, -NAN, INFINITY, 0x1p-140f, -2.0f}) {
      const std::string what = "scale " + std::to_string(s) + " -> " + dtype_name(fp8);
      Tensor want = filled({9, 300}, fp8, 0);
      quantize_per_tensor(cpu, x, scalar(s), want);
      Tensor got = on_gpu(filled({9, 300}, fp8, 0x5A));
      quantize_per_tensor(gpu, on_gpu(x), on_gpu(scalar(s)), got);
      expect_same_but_nan_pairs(to_cpu(got), want, what,
                                [&](int64_t i) { return std::isnan(s) && std::isnan(x.item(i)); });
    }
    // amax_out may be the scale tensor itself: the scale is read before amax overwrites it.
    Tensor shared_cpu = scalar(3.0f), want = filled({9, 300}, fp8, 0);
    quantize_per_tensor(cpu, x, shared_cpu, want, shared_cpu);
    Tensor shared_gpu = on_gpu(scalar(3.0f)), got = on_gpu(filled({9, 300}, fp8, 0x5A));
    quantize_per_tensor(gpu, on_gpu(x), shared_gpu, got, shared_gpu);
    expect_same_bytes(to_cpu(got), want, "aliased amax");
    expect_same_bytes(to_cpu(shared_gpu), shared_cpu, "aliased amax value");
  }
  // Empty and all-zero tensors: amax 0.
  for (int64_t n : {0, 1000}) {
    Tensor z = Tensor::zeros({n}, DType::BF16);
    Tensor want = filled({n}, DType::E4M3, 0), want_amax = filled({1}, DType::F32, 0x5A);
    quantize_per_tensor(cpu, z, scalar(448.0f), want, want_amax);
    Tensor got = on_gpu(filled({n}, DType::E4M3, 0x5A)), got_amax = on_gpu(filled({1}, DType::F32, 0x5A));
    quantize_per_tensor(gpu, on_gpu(z), on_gpu(scalar(448.0f)), got, got_amax);
    expect_same_bytes(to_cpu(got), want, "zeros");
    expect_same_bytes(to_cpu(got_amax), want_amax, "zeros amax");
  }
}

TEST(GpuQuantize, DequantizePerTensorMatchesTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (DType fp8 : kFp8) {
    for (int64_t n : {1, 16, 257, 5000}) {
      Tensor q = all_codes(1, n, fp8, n).reshape({n});
      for (DType out : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
        for (float s : {1.0f, 0.0078125f, 3.7f, 0x1p-130f, 1e30f, NAN}) {
          for (int64_t misalign : {0, 1}) {
            const std::string what = describe_case("dequantize scale_inv " + std::to_string(s), q, out, misalign);
            Tensor want = filled({n}, out, 0);
            dequantize_per_tensor(cpu, q, scalar(s), want);
            for (uint8_t p : kPoison) {
              Tensor got = on_gpu(filled({n}, out, p), misalign);
              dequantize_per_tensor(gpu, on_gpu(q, misalign), on_gpu(scalar(s)), got);
              expect_same_but_nan_pairs(to_cpu(got), want, what, [&](int64_t i) {
                return std::isnan(s) && code_is_nan(fp8, q.data<uint8_t>()[i]);
              });
            }
          }
        }
      }
    }
  }
}

// ---- Block scaling ----------------------------------------------------------------------------

TEST(GpuQuantize, BlockwiseMatchesTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const std::vector<BlockScaling> recipes = {BlockScaling::tile_1x128(),       BlockScaling::tile_1x128(false),
                                             BlockScaling::tile_128x128(),     BlockScaling::tile_128x128(false),
                                             BlockScaling{3, 5, true},         BlockScaling{1, 2048, false},
                                             BlockScaling{256, 256, true}};
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{130, 257}, {130, 256}, {1, 1}, {3, 130}, {256, 384},
                                                           {2, 128},   {129, 4100}};
  uint64_t seed = 300;
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F64, DType::E4M3}) {
    for (auto [rows, cols] : shapes) {
      const bool main_dtype = t == DType::F32 || t == DType::BF16;
      if (!main_dtype && rows * cols > 40000) continue;
      Tensor x = special_input(rows, cols, t, seed++);
      for (const BlockScaling& b : recipes) {
        // The wide shape is there for the whole-block teams (tiles of 2048 or more elements).
        if (cols > 1000 && b.block_rows * b.block_cols < 2048) continue;
        const Shape grid = block_scale_shape(rows, cols, b);
        for (DType fp8 : kFp8) {
          for (int64_t misalign : {0, 1}) {
            if (misalign && !main_dtype) continue;
            const std::string what = describe_case("blocks " + std::to_string(b.block_rows) + "x" +
                                                       std::to_string(b.block_cols) + (b.power_of_two_scales ? " pow2" : ""),
                                                   x, fp8, misalign);
            Tensor want = filled({rows, cols}, fp8, 0), want_inv = filled(grid, DType::F32, 0);
            quantize_blockwise(cpu, x, want, want_inv, b);
            for (uint8_t p : kPoison) {
              Tensor got = on_gpu(filled({rows, cols}, fp8, p), misalign), got_inv = on_gpu(filled(grid, DType::F32, p));
              quantize_blockwise(gpu, on_gpu(x, misalign), got, got_inv, b);
              expect_same_bytes(to_cpu(got), want, what);
              expect_same_bytes(to_cpu(got_inv), want_inv, what + " scale_inv");
            }
            if (!main_dtype) continue;
            for (DType out : {DType::F32, DType::BF16, DType::F64, DType::F16}) {
              Tensor back_want = filled({rows, cols}, out, 0);
              dequantize_blockwise(cpu, want, want_inv, back_want, b);
              for (uint8_t p : kPoison) {
                Tensor back = on_gpu(filled({rows, cols}, out, p), misalign);
                dequantize_blockwise(gpu, on_gpu(want, misalign), on_gpu(want_inv), back, b);
                expect_same_but_nan_pairs(to_cpu(back), back_want, what + " dequantized to " + dtype_name(out),
                                        kNeverBothNan);  // scale_inv is never NaN
              }
            }
          }
        }
      }
    }
  }
}

TEST(GpuQuantize, BlockwiseZeroTensorAndEveryCode) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (const BlockScaling& b : {BlockScaling::tile_1x128(), BlockScaling::tile_128x128(false)}) {
    const Shape grid = block_scale_shape(130, 257, b);
    Tensor z = Tensor::zeros({130, 257}, DType::BF16);
    Tensor want = filled({130, 257}, DType::E4M3, 0), want_inv = filled(grid, DType::F32, 0);
    quantize_blockwise(cpu, z, want, want_inv, b);
    Tensor got = on_gpu(filled({130, 257}, DType::E4M3, 0x5A)), got_inv = on_gpu(filled(grid, DType::F32, 0x5A));
    quantize_blockwise(gpu, on_gpu(z), got, got_inv, b);
    expect_same_bytes(to_cpu(got), want, "zero tensor");
    expect_same_bytes(to_cpu(got_inv), want_inv, "zero tensor scale_inv");
    // Dequantize arbitrary codes (NaN codes too) with arbitrary scales, a NaN scale among them.
    for (DType fp8 : kFp8) {
      Tensor q = all_codes(130, 256, fp8, 3);
      const Shape g2 = block_scale_shape(130, 256, b);
      Tensor inv = random_tensor(g2, DType::F32, 9, 0.0f, 4.0f);
      inv.set_item(0, NAN);
      Tensor back_want = filled({130, 256}, DType::BF16, 0);
      dequantize_blockwise(cpu, q, inv, back_want, b);
      Tensor back = on_gpu(filled({130, 256}, DType::BF16, 0x5A));
      dequantize_blockwise(gpu, on_gpu(q), on_gpu(inv), back, b);
      expect_same_but_nan_pairs(to_cpu(back), back_want, std::string("every code ") + dtype_name(fp8), [&](int64_t i) {
        const int64_t r = i / 256, c = i % 256;
        const float s = inv.data<float>()[(r / b.block_rows) * g2[1] + c / b.block_cols];
        return std::isnan(s) && code_is_nan(fp8, q.data<uint8_t>()[i]);
      });
    }
  }
}

// ---- MXFP8 ------------------------------------------------------------------------------------

TEST(GpuQuantize, Mxfp8MatchesTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{130, 257}, {130, 256}, {1, 1}, {3, 31}, {64, 1024}, {9, 70}};
  uint64_t seed = 400;
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F64, DType::E5M2}) {
    for (auto [rows, cols] : shapes) {
      const bool main_dtype = t == DType::F32 || t == DType::BF16;
      Tensor x = special_input(rows, cols, t, seed++);
      if (rows == 9) {
        // Block amaxes in (448, 512) * 2^k: elements past E4M3's largest value saturate.
        std::vector<float> v = x.to_floats();
        for (int64_t c = 0; c < cols; ++c) v[8 * cols + c] = (c % 2 ? 1.0f : -1.0f) * (500.0f + c) * 0x1p-20f;
        x = Tensor::from_floats(v, {rows, cols}, t);
      }
      const Shape grid = {rows, (cols + 31) / 32};
      for (DType fp8 : kFp8) {
        for (int64_t misalign : {0, 1}) {
          if (misalign && !main_dtype) continue;
          const std::string what = describe_case("mxfp8", x, fp8, misalign);
          Tensor want = filled({rows, cols}, fp8, 0), want_scales = filled(grid, DType::E8M0, 0);
          quantize_mxfp8(cpu, x, want, want_scales);
          for (uint8_t p : kPoison) {
            Tensor got = on_gpu(filled({rows, cols}, fp8, p), misalign), got_scales = on_gpu(filled(grid, DType::E8M0, p));
            quantize_mxfp8(gpu, on_gpu(x, misalign), got, got_scales);
            expect_same_bytes(to_cpu(got), want, what);
            expect_same_bytes(to_cpu(got_scales), want_scales, what + " scales");
          }
          if (!main_dtype) continue;
          for (DType out : {DType::F32, DType::BF16, DType::F64, DType::F16}) {
            Tensor back_want = filled({rows, cols}, out, 0);
            dequantize_mxfp8(cpu, want, want_scales, back_want);
            for (uint8_t p : kPoison) {
              Tensor back = on_gpu(filled({rows, cols}, out, p), misalign);
              dequantize_mxfp8(gpu, on_gpu(want, misalign), on_gpu(want_scales), back);
              expect_same_but_nan_pairs(to_cpu(back), back_want, what + " dequantized to " + dtype_name(out),
                                      [&](int64_t i) {
                                        const int64_t r = i / cols, c = i % cols;
                                        return want_scales.data<uint8_t>()[r * grid[1] + c / 32] == 0xff &&
                                               code_is_nan(fp8, want.data<uint8_t>()[i]);
                                      });
            }
          }
        }
      }
    }
  }
}

TEST(GpuQuantize, Mxfp8ZeroTensorAndEveryScaleCode) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  Tensor z = Tensor::zeros({5, 100}, DType::F32);
  Tensor want = filled({5, 100}, DType::E5M2, 0), want_scales = filled({5, 4}, DType::E8M0, 0x5A);
  quantize_mxfp8(cpu, z, want, want_scales);
  Tensor got = on_gpu(filled({5, 100}, DType::E5M2, 0x5A)), got_scales = on_gpu(filled({5, 4}, DType::E8M0, 0x5A));
  quantize_mxfp8(gpu, on_gpu(z), got, got_scales);
  expect_same_bytes(to_cpu(got), want, "zero tensor");
  expect_same_bytes(to_cpu(got_scales), want_scales, "zero tensor scales");
  // Every scale code 0..255 (2^-127 subnormal, 2^127, NaN) over every element code.
  for (DType fp8 : kFp8) {
    Tensor q = all_codes(16, 512, fp8, 11);
    Tensor scales = Tensor::empty({16, 16}, DType::E8M0);
    for (int i = 0; i < 256; ++i) scales.data<uint8_t>()[i] = static_cast<uint8_t>(i);
    for (DType out : {DType::F32, DType::F64, DType::BF16, DType::F16}) {
      Tensor back_want = filled({16, 512}, out, 0);
      dequantize_mxfp8(cpu, q, scales, back_want);
      Tensor back = on_gpu(filled({16, 512}, out, 0x5A));
      dequantize_mxfp8(gpu, on_gpu(q), on_gpu(scales), back);
      expect_same_but_nan_pairs(to_cpu(back), back_want,
                              std::string("every scale code ") + dtype_name(fp8) + " -> " + dtype_name(out),
                              [&](int64_t i) {
                                return scales.data<uint8_t>()[(i / 512) * 16 + (i % 512) / 32] == 0xff &&
                                       code_is_nan(fp8, q.data<uint8_t>()[i]);
                              });
    }
  }
}
