#include "tessera/core/tensor.h"

#include "tessera/core/allocator.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

static Tensor iota(const Shape& shape, DType dtype = DType::F32) {
  Tensor t = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, static_cast<double>(i));
  return t;
}

TEST(Tensor, EmptyHasContiguousStrides) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::BF16);
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.describe(), "bf16[2, 3, 4] on cpu");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 64, 0u);
}

TEST(Tensor, ZeroSizedTensorsAreValid) {
  Tensor t = Tensor::zeros({0, 5}, DType::F32);
  EXPECT_EQ(t.numel(), 0);
  EXPECT_TRUE(t.clone().defined());
  EXPECT_THROW(Tensor::empty({-1, 2}, DType::F32), Error);
}

TEST(Tensor, SliceSharesStorage) {
  Tensor t = iota({4, 5});
  Tensor s = t.slice(0, 1, 3);
  EXPECT_EQ(s.shape(), (Shape{2, 5}));
  EXPECT_TRUE(s.shares_storage(t));
  EXPECT_EQ(s.item(0), 5.0);
  s.set_item(0, 100);
  EXPECT_EQ(t.item(5), 100.0);  // a view, not a copy
  Tensor c = t.slice(1, 2, 4);  // column slice: not contiguous
  EXPECT_FALSE(c.is_contiguous());
  EXPECT_EQ(c.contiguous().to_doubles(), (std::vector<double>{2, 3, 7, 8, 12, 13, 17, 18}));
  EXPECT_THROW(t.slice(0, 3, 5), Error);
  EXPECT_THROW(t.slice(2, 0, 1), Error);
}

TEST(Tensor, TransposeIsAStridedView) {
  Tensor t = iota({2, 3});
  Tensor tt = t.transpose(0, 1);
  EXPECT_EQ(tt.shape(), (Shape{3, 2}));
  EXPECT_FALSE(tt.is_contiguous());
  EXPECT_EQ(tt.contiguous().to_doubles(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  EXPECT_THROW(tt.reshape({6}), Error);  // reshape needs contiguous memory
}

TEST(Tensor, ReshapeInfersOneDimension) {
  Tensor t = iota({2, 3, 4});
  EXPECT_EQ(t.reshape({-1, 4}).shape(), (Shape{6, 4}));
  EXPECT_EQ(t.reshape({4, -1}).shape(), (Shape{4, 6}));
  EXPECT_THROW(t.reshape({5, -1}), Error);
  EXPECT_THROW(t.reshape({-1, -1}), Error);
  EXPECT_THROW(t.reshape({7}), Error);
}

TEST(Tensor, SelectDropsADimension) {
  Tensor t = iota({3, 4});
  Tensor row = t.select(0, 2);
  EXPECT_EQ(row.shape(), (Shape{4}));
  EXPECT_EQ(row.to_doubles(), (std::vector<double>{8, 9, 10, 11}));
  Tensor col = t.select(1, 1);
  EXPECT_EQ(col.to_doubles(), (std::vector<double>{1, 5, 9}));
  EXPECT_THROW(t.select(0, 3), Error);
}

TEST(Tensor, CopyFromHandlesStridesAndChecksShapes) {
  Tensor src = iota({3, 4});
  Tensor dst = Tensor::zeros({4, 3}, DType::F32);
  dst.copy_from(src.transpose(0, 1));
  EXPECT_EQ(dst.item(1), 4.0);
  Tensor wrong = Tensor::zeros({3, 3}, DType::F32);
  EXPECT_THROW(wrong.copy_from(src), Error);
  Tensor other_dtype = Tensor::zeros({3, 4}, DType::F64);
  EXPECT_THROW(other_dtype.copy_from(src), Error);
}

TEST(Tensor, FromValuesRoundsToTheDtype) {
  Tensor t = Tensor::from_floats({1.0f, 1.00390625f}, {2}, DType::BF16);  // 1 + 2^-8 ties to 1
  EXPECT_EQ(t.to_floats(), (std::vector<float>{1.0f, 1.0f}));
  EXPECT_THROW(Tensor::from_floats({1.0f}, {2}), Error);
  Tensor ids = Tensor::from_ints({3, -1, 7}, {3}, DType::I64);
  EXPECT_EQ(ids.to_ints(), (std::vector<int64_t>{3, -1, 7}));
  EXPECT_THROW(t.to_ints(), Error);
}

TEST(Tensor, WrapDoesNotOwn) {
  std::vector<float> memory = {1, 2, 3, 4};
  {
    Tensor t = Tensor::wrap(memory.data(), {2, 2}, DType::F32);
    t.set_item(3, 9);
  }
  EXPECT_EQ(memory[3], 9.0f);  // still alive after the tensor is gone
  EXPECT_THROW(Tensor::wrap(nullptr, {2}, DType::F32), Error);
}

TEST(Tensor, ViewAsKeepsBytes) {
  Tensor t = Tensor::from_ints({0x3f80}, {1}, DType::I32);
  EXPECT_THROW(t.view_as(DType::BF16), Error);  // element sizes differ
  Tensor b = Tensor::zeros({2}, DType::BF16);
  EXPECT_EQ(b.view_as(DType::F16).dtype(), DType::F16);
}

TEST(Tensor, BytesAsViewsPartOfTheMemory) {
  // 4 BF16 elements (8 bytes), viewed from element 1 on: bytes 2..7 of the storage.
  Tensor b = Tensor::zeros({5}, DType::BF16).slice(0, 1, 5);
  const Tensor lo = b.bytes_as(DType::E4M3, {2, 2});
  const Tensor hi = b.bytes_as(DType::E4M3, {4}, 4);
  EXPECT_TRUE(lo.shares_storage(b) && hi.shares_storage(b));
  EXPECT_EQ(lo.raw_data(), b.raw_data());
  EXPECT_EQ(static_cast<char*>(hi.raw_data()), static_cast<char*>(b.raw_data()) + 4);
  EXPECT_EQ(lo.stride(0), 2);
  static_cast<unsigned char*>(hi.raw_data())[2] = 0x80;  // bytes 6 and 7: BF16 element 3,
  static_cast<unsigned char*>(hi.raw_data())[3] = 0x3f;  // 0x3f80 = 1.0
  EXPECT_EQ(b.item(3), 1.0);
  EXPECT_THROW(b.bytes_as(DType::I32, {1}), Error);        // the view starts at storage byte 2
  EXPECT_EQ(b.bytes_as(DType::I32, {1}, 2).numel(), 1);   // storage byte 4: aligned
  EXPECT_THROW(b.bytes_as(DType::E4M3, {9}), Error);      // more than the 8 bytes
  EXPECT_THROW(b.bytes_as(DType::E4M3, {2}, 7), Error);   // past the end
  EXPECT_THROW(b.bytes_as(DType::BF16, {1}, 1), Error);   // misaligned
  EXPECT_THROW(b.bytes_as(DType::E4M3, {-1}), Error);
  EXPECT_THROW(Tensor::zeros({2, 2}, DType::BF16).transpose(0, 1).bytes_as(DType::E4M3, {8}), Error);
  EXPECT_THROW(Tensor().bytes_as(DType::E4M3, {1}), Error);
}

TEST(Tensor, UndefinedTensorGivesClearErrors) {
  Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_THROW(t.clone(), Error);
  EXPECT_THROW(t.size(0), Error);
  try {
    check_contiguous(t, "my_op", "input");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("my_op: input is an undefined"), std::string::npos) << e.what();
  }
}

TEST(Tensor, CudaWithoutBackendIsAClearError) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is present; this checks the CPU-only error";
  EXPECT_THROW(Tensor::empty({4}, DType::F32, Device::cuda(0)), Error);
}

TEST(DType, NamesRoundTrip) {
  for (DType t : {DType::F64, DType::F32, DType::F16, DType::BF16, DType::E4M3, DType::E5M2, DType::E8M0, DType::I64,
                  DType::I32, DType::U8}) {
    EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  }
  EXPECT_THROW(dtype_from_name("fp7"), Error);
  EXPECT_EQ(dtype_size(DType::E4M3), 1u);
  EXPECT_TRUE(is_fp8(DType::E5M2));
  EXPECT_FALSE(is_floating(DType::I32));
}
