// CUDA embedding forward and backward against the CPU reference: I32 and I64 ids, F32 and
// BF16 tables and gradients in every combination (equal dtypes of other widths through the
// raw-copy path), odd channel counts and misaligned views (scalar paths), heavily repeated
// ids (runs longer than a block), accumulation into a non-zero d_table, run-to-run
// bit-identity of the backward, NaN gradients, and bad ids reported at the next call.
// Skipped (saying so) where no GPU is present.
#include <cmath>
#include <cstring>
#include <string>

#include "tessera/core/allocator.h"
#include "tessera/ops/embedding.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// ids in [0, vocab): a mix of random ids and one id repeated `repeats` times.
Tensor make_ids(const Shape& shape, DType t, int64_t vocab, uint64_t seed, int64_t repeats = 0) {
  Tensor u = random_tensor(shape, DType::F64, seed, 0.0f, 1.0f);
  std::vector<int64_t> v(static_cast<size_t>(u.numel()));
  for (int64_t i = 0; i < u.numel(); ++i) {
    v[i] = std::min<int64_t>(vocab - 1, static_cast<int64_t>(u.item(i) * vocab));
    if (i % 3 == 1 && repeats > 0) v[i] = vocab / 2;
  }
  for (int64_t i = 0; i < std::min<int64_t>(repeats, u.numel()); ++i) v[u.numel() - 1 - i] = vocab / 2;
  return Tensor::from_ints(v, shape, t);
}

Shape with_channels(Shape s, int64_t c) {
  s.push_back(c);
  return s;
}

}  // namespace

TEST(GpuEmbedding, ForwardMatchesTheCpuBitForBit) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 100;
  struct Case {
    Shape ids;
    int64_t vocab, channels;
  };
  const Case cases[] = {{{1}, 1, 1}, {{7}, 5, 8}, {{3, 5}, 50, 7}, {{2, 64}, 1000, 768}, {{33}, 300, 1001}, {{}, 4, 16},
                        {{0}, 3, 8}};
  const std::pair<DType, DType> dtypes[] = {{DType::F32, DType::F32},   {DType::BF16, DType::BF16},
                                            {DType::F32, DType::BF16},  {DType::BF16, DType::F32},
                                            {DType::F16, DType::F16},   {DType::E4M3, DType::E4M3},
                                            {DType::F64, DType::F64}};
  for (const Case& k : cases) {
    for (auto [tt, ot] : dtypes) {
      for (DType id_t : {DType::I32, DType::I64}) {
        for (bool misaligned : {false, true}) {
          const std::string what = std::string(dtype_name(tt)) + "->" + dtype_name(ot) + " ids " +
                                   dtype_name(id_t) + shape_to_string(k.ids) + " V=" + std::to_string(k.vocab) +
                                   " C=" + std::to_string(k.channels) + (misaligned ? " misaligned" : "");
          const Tensor table = random_tensor({k.vocab, k.channels}, tt, seed++, -3.0f, 3.0f);
          const Tensor ids = make_ids(k.ids, id_t, k.vocab, seed++);
          Tensor want = Tensor::empty(with_channels(k.ids, k.channels), ot);
          embedding_forward(cpu, ids, table, want);
          Tensor got = poisoned_device(want.shape(), ot, misaligned);
          embedding_forward(gpu, ids.to(kCuda), to_device(table, misaligned), got);
          EXPECT_EQ(bytes_of(got), bytes_of(want)) << what;
        }
      }
    }
  }
}

TEST(GpuEmbedding, BackwardAccumulatesLikeTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 200;
  struct Case {
    Shape ids;
    int64_t vocab, channels, repeats;
  };
  // The 600-fold repeat makes a run longer than one 256-thread window of the run search.
  const Case cases[] = {{{1}, 1, 1, 0},        {{6}, 5, 7, 2},          {{4, 9}, 3, 8, 0},
                        {{2, 64}, 1000, 768, 40}, {{1000}, 50, 24, 600}, {{257}, 2000, 1001, 5},
                        {{0}, 4, 8, 0},        {{5}, 7, 0, 0}};
  const std::pair<DType, DType> dtypes[] = {{DType::F32, DType::F32},
                                            {DType::BF16, DType::F32},  // mixed precision: BF16 grads into F32
                                            {DType::BF16, DType::BF16},
                                            {DType::F32, DType::BF16}};
  for (const Case& k : cases) {
    for (auto [gt, dt] : dtypes) {
      for (DType id_t : {DType::I32, DType::I64}) {
        for (bool misaligned : {false, true}) {
          const std::string what = std::string("d_out ") + dtype_name(gt) + " d_table " + dtype_name(dt) + " ids " +
                                   dtype_name(id_t) + shape_to_string(k.ids) + " V=" + std::to_string(k.vocab) +
                                   " C=" + std::to_string(k.channels) + (misaligned ? " misaligned" : "");
          const Tensor ids = make_ids(k.ids, id_t, k.vocab, seed++, k.repeats);
          const Tensor d_out = random_tensor(with_channels(k.ids, k.channels), gt, seed++);
          const Tensor start = random_tensor({k.vocab, k.channels}, dt, seed++);  // accumulates onto this
          Tensor want = start.clone();
          embedding_backward(cpu, ids, d_out, want);
          Tensor got = to_device(start, misaligned);
          embedding_backward(gpu, ids.to(kCuda), to_device(d_out, misaligned), got);
          // Sums in another order than the CPU's: float rounding (F32), one BF16 step (BF16).
          const double tol = dt == DType::BF16 ? 1e-2 : 1e-5;
          EXPECT_LT(relative_error(got.to(Device::cpu()), want), tol) << what;
          // Deterministic: the same inputs give the same bits.
          Tensor again = to_device(start, misaligned);
          embedding_backward(gpu, ids.to(kCuda), to_device(d_out, misaligned), again);
          EXPECT_EQ(bytes_of(again), bytes_of(got)) << what;
        }
      }
    }
  }
}

TEST(GpuEmbedding, UntouchedRowsKeepTheirBitsAndNanGradientsStayInTheirRow) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const int64_t vocab = 6, channels = 16;
  const Tensor ids = Tensor::from_ints({1, 4, 1, 3}, {4}, DType::I32);
  Tensor d_out = random_tensor({4, channels}, DType::BF16, 7);
  d_out.set_item(2 * channels + 5, NAN);  // position 2 -> id 1, channel 5
  const Tensor start = random_tensor({vocab, channels}, DType::F32, 8);
  Tensor d_table = start.to(kCuda);
  embedding_backward(gpu, ids.to(kCuda), d_out.to(kCuda), d_table);
  const Tensor got = d_table.to(Device::cpu());
  for (int64_t r = 0; r < vocab; ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      const double v = got.item(r * channels + c);
      if (r == 1 && c == 5) EXPECT_TRUE(std::isnan(v));
      else EXPECT_FALSE(std::isnan(v)) << r << ", " << c;
      if (r == 0 || r == 2 || r == 5) EXPECT_EQ(v, start.item(r * channels + c)) << "row " << r << " untouched";
    }
  }
}

TEST(GpuEmbedding, BadIdsAreReportedByTheNextCall) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const int64_t vocab = 5, channels = 8;
  const Tensor table = random_tensor({vocab, channels}, DType::F32, 9).to(kCuda);
  const Tensor good = Tensor::from_ints({0, 4}, {2}, DType::I64).to(kCuda);
  const Tensor bad = Tensor::from_ints({2, 99, 1}, {3}, DType::I64).to(kCuda);

  // Forward: no exception at the call (no host sync); the bad row is NaN, the others right.
  Tensor out = poisoned_device({3, channels}, DType::F32);
  embedding_forward(gpu, bad, table, out);
  const Tensor host_out = out.to(Device::cpu());  // waits for the kernel
  const Tensor host_table = table.to(Device::cpu());
  for (int64_t c = 0; c < channels; ++c) {
    EXPECT_EQ(host_out.item(c), host_table.item(2 * channels + c));
    EXPECT_TRUE(std::isnan(host_out.item(channels + c)));
    EXPECT_EQ(host_out.item(2 * channels + c), host_table.item(channels + c));
  }
  Tensor out2 = Tensor::empty({2, channels}, DType::F32, kCuda);
  try {
    embedding_forward(gpu, good, table, out2);
    ADD_FAILURE() << "the bad id was not reported";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("id 99"), std::string::npos) << msg;
    EXPECT_NE(msg.find("position 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[0, 5)"), std::string::npos) << msg;
  }
  // Reported once: the next call runs normally.
  EXPECT_NO_THROW(embedding_forward(gpu, good, table, out2));
  synchronize(gpu);
  EXPECT_NO_THROW(embedding_forward(gpu, good, table, out2));

  // Backward: the bad position adds nothing, the others add as usual; reported next call.
  const Tensor bad32 = Tensor::from_ints({-1, 3}, {2}, DType::I32).to(kCuda);
  const Tensor d_out = random_tensor({2, channels}, DType::F32, 10);
  Tensor d_table = Tensor::zeros({vocab, channels}, DType::F32, kCuda);
  embedding_backward(gpu, bad32, d_out.to(kCuda), d_table);
  const Tensor grads = d_table.to(Device::cpu());
  for (int64_t c = 0; c < channels; ++c) {
    EXPECT_EQ(grads.item(3 * channels + c), d_out.item(channels + c));
    for (int64_t r : {0, 1, 2, 4}) EXPECT_EQ(grads.item(r * channels + c), 0.0);
  }
  EXPECT_THROW(embedding_backward(gpu, good, Tensor::zeros({2, channels}, DType::F32, kCuda), d_table), Error);
}

TEST(GpuEmbedding, UnsupportedDtypesAreAClearError) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const Tensor ids = Tensor::from_ints({0}, {1}, DType::I32).to(kCuda);
  Tensor d_table = Tensor::zeros({2, 4}, DType::F64, kCuda);
  EXPECT_THROW(embedding_backward(gpu, ids, Tensor::zeros({1, 4}, DType::F64, kCuda), d_table), Error);
  Tensor out = Tensor::zeros({1, 4}, DType::F16, kCuda);
  EXPECT_THROW(embedding_forward(gpu, ids, Tensor::zeros({2, 4}, DType::F32, kCuda), out), Error);
}
