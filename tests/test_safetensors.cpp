// safetensors: round trips of every dtype (bit exact), the on-disk layout, a hand-built file
// as another implementation writes it, every malformed header, sharded checkpoints, and
// interop with the Python `safetensors` package when it is installed.
#include "tessera/io/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io_testing.h"
#include "tessera/io/atomic_file.h"

using namespace tessera;
using namespace tessera::testing;


TEST(Safetensors, DTypeCodes) {
  for (DType d : kAllDTypes) EXPECT_EQ(io::dtype_from_safetensors_code(io::safetensors_dtype_code(d)), d);
  EXPECT_STREQ(io::safetensors_dtype_code(DType::E4M3), "F8_E4M3");
  EXPECT_STREQ(io::safetensors_dtype_code(DType::E8M0), "F8_E8M0");
  EXPECT_EQ(io::dtype_from_safetensors_code("BOOL"), std::nullopt);
  EXPECT_THROW(io::dtype_from_safetensors_code("F128"), Error);
}

TEST(Safetensors, RoundTripsEveryDTypeBitExactly) {
  TempDir dir;
  io::NamedTensors tensors;
  int seed = 0;
  for (DType d : kAllDTypes) {
    const std::string code = io::safetensors_dtype_code(d);
    tensors.emplace_back(code + ".matrix", pattern_tensor({3, 5}, d, ++seed));
    tensors.emplace_back(code + ".scalar", pattern_tensor({}, d, ++seed));
    tensors.emplace_back(code + ".empty", pattern_tensor({0, 4}, d, ++seed));
    tensors.emplace_back(code + ".odd", pattern_tensor({1, 7, 1, 3}, d, ++seed));
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "h\xC3\xA9llo \xE2\x9C\x93"}};
  const std::string path = dir.file("all.safetensors");
  io::save_safetensors(path, tensors, metadata);

  io::SafetensorsFile file(path);
  EXPECT_EQ(file.size(), tensors.size());
  EXPECT_EQ(file.metadata(), metadata);
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(file.contains(name)) << name;
    const io::TensorInfo& info = file.info(name);
    EXPECT_EQ(info.shape, t.shape()) << name;
    EXPECT_EQ(info.dtype, t.dtype()) << name;
    EXPECT_EQ(info.dtype_code, io::safetensors_dtype_code(t.dtype())) << name;
    const Tensor back = file.get(name);
    EXPECT_EQ(back.shape(), t.shape()) << name;
    EXPECT_EQ(back.dtype(), t.dtype()) << name;
    EXPECT_EQ(bytes_of(back), bytes_of(t)) << name;
    EXPECT_TRUE(back.defined());
  }
  // The tensors own their memory: they outlive the file object.
  Tensor kept;
  { kept = io::SafetensorsFile(path).get("BF16.matrix"); }
  EXPECT_EQ(bytes_of(kept), bytes_of(tensors[12].second));

  const auto all = io::load_safetensors(path);
  EXPECT_EQ(all.size(), tensors.size());
  EXPECT_EQ(bytes_of(all.at("F64.odd")), bytes_of(tensors[3].second));
  EXPECT_EQ(all.at("U8.scalar").dim(), 0);
  EXPECT_EQ(all.at("I32.empty").shape(), (Shape{0, 4}));
}

TEST(Safetensors, LayoutIsAlignedAndFullyCovered) {
  TempDir dir;
  const io::NamedTensors tensors = {{"u8", pattern_tensor({3}, DType::U8, 1)},
                                    {"bf16", pattern_tensor({5}, DType::BF16, 2)},
                                    {"f64", pattern_tensor({2, 3}, DType::F64, 3)},
                                    {"i32", pattern_tensor({7}, DType::I32, 4)},
                                    {"e4m3", pattern_tensor({1}, DType::E4M3, 5)}};
  const std::string path = dir.file("layout.safetensors");
  io::save_safetensors(path, tensors, {{"k", "v"}});
  const std::string bytes = io::read_file(path);
  EXPECT_EQ(bytes, io::serialize_safetensors(tensors, {{"k", "v"}}));

  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes[8], '{');
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.substr(header.find_last_not_of(' ') + 1), std::string(header.size() - 1 - header.rfind('}'), ' '));
  EXPECT_LT(header.size() - 1 - header.rfind('}'), 8u);  // padding only, with spaces

  io::SafetensorsFile file(path);
  EXPECT_EQ(file.header_bytes(), n);
  uint64_t covered = 0;
  for (const io::TensorInfo& info : file.infos()) {
    EXPECT_EQ(info.data_begin, covered) << info.name << ": a gap or overlap";
    EXPECT_EQ(info.data_begin % dtype_size(*info.dtype), 0u) << info.name << " is not aligned to its element";
    covered = info.data_end;
  }
  EXPECT_EQ(covered, file.data_bytes());
  // Largest elements first, then the order given.
  EXPECT_EQ(file.names(), (std::vector<std::string>{"f64", "i32", "bf16", "u8", "e4m3"}));
  EXPECT_EQ(file.sorted_names(), (std::vector<std::string>{"bf16", "e4m3", "f64", "i32", "u8"}));
  EXPECT_EQ(std::memcmp(file.raw_bytes("i32"), tensors[3].second.raw_data(), 28), 0);
}

TEST(Safetensors, WritesNonContiguousTensors) {
  TempDir dir;
  const Tensor base = pattern_tensor({4, 6}, DType::F32, 9);
  const Tensor transposed = base.transpose(0, 1);
  const Tensor columns = base.slice(1, 2, 5);
  const Tensor row = base.select(0, 2);  // contiguous but with an offset
  ASSERT_FALSE(transposed.is_contiguous());
  ASSERT_FALSE(columns.is_contiguous());
  const std::string path = dir.file("views.safetensors");
  io::save_safetensors(path, {{"t", transposed}, {"c", columns}, {"r", row}});
  io::SafetensorsFile file(path);
  EXPECT_EQ(file.info("t").shape, (Shape{6, 4}));
  EXPECT_EQ(file.get("t").to_doubles(), transposed.contiguous().to_doubles());
  EXPECT_EQ(file.get("c").to_doubles(), columns.contiguous().to_doubles());
  EXPECT_EQ(file.get("r").to_doubles(), row.to_doubles());
}

TEST(Safetensors, ReadIntoPreallocatedTensors) {
  TempDir dir;
  const Tensor w = pattern_tensor({3, 4}, DType::BF16, 4);
  const std::string path = dir.file("w.safetensors");
  io::save_safetensors(path, {{"w", w}});
  io::SafetensorsFile file(path);
  Tensor dst = Tensor::zeros({3, 4}, DType::BF16);
  file.read_into("w", dst);
  EXPECT_EQ(bytes_of(dst), bytes_of(w));
  Tensor holder = Tensor::zeros({4, 3}, DType::BF16);
  Tensor strided = holder.transpose(0, 1);
  file.read_into("w", strided);
  EXPECT_EQ(bytes_of(strided), bytes_of(w));
  Tensor wrong_shape = Tensor::zeros({4, 3}, DType::BF16);
  Tensor wrong_dtype = Tensor::zeros({3, 4}, DType::F32);
  Tensor undefined;
  EXPECT_THROW(file.read_into("w", wrong_shape), Error);
  EXPECT_THROW(file.read_into("w", wrong_dtype), Error);
  EXPECT_THROW(file.read_into("w", undefined), Error);
  EXPECT_THROW(file.read_into("absent", dst), Error);
}

// Written byte by byte, as another implementation would: keys in no particular order,
// metadata in the middle, a 0-d I64, and bytes we know the values of.
TEST(Safetensors, ReadsAHandBuiltFile) {
  TempDir dir;
  const std::string header =
      R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"format":"pt","who":"hand"},)"
      R"("a":{"dtype":"I64","shape":[],"data_offsets":[8,16]},)"
      R"("h":{"dtype":"BF16","shape":[1,2],"data_offsets":[16,20]},)"
      R"("z":{"dtype":"F16","shape":[0,3],"data_offsets":[20,20]},)"
      R"("q":{"dtype":"U8","shape":[3],"data_offsets":[20,23]}})";
  std::string data = f32_bytes({1.5f, -2.0f});
  data += std::string("\xF9\xFF\xFF\xFF\xFF\xFF\xFF\xFF", 8);  // -7
  data += std::string("\x80\x3F\x00\xC0", 4);                  // bf16 1.0, -2.0
  data += std::string("\x00\x7F\xFF", 3);
  const std::string path = dir.file("hand.safetensors");
  write_raw(path, build_file(header, data));

  io::SafetensorsFile file(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"b", "a", "h", "z", "q"}));
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"who", "hand"}}));
  EXPECT_EQ(file.get("b").to_doubles(), (std::vector<double>{1.5, -2.0}));
  const Tensor a = file.get("a");
  EXPECT_EQ(a.dim(), 0);
  EXPECT_EQ(a.dtype(), DType::I64);
  EXPECT_EQ(a.to_ints(), (std::vector<int64_t>{-7}));
  EXPECT_EQ(file.get("h").to_doubles(), (std::vector<double>{1.0, -2.0}));
  EXPECT_EQ(file.get("z").shape(), (Shape{0, 3}));
  EXPECT_EQ(file.get("q").to_ints(), (std::vector<int64_t>{0, 127, 255}));

  // Unpadded header (N not a multiple of 8) is legal for readers too.
  const std::string tight = R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  write_raw(path, le64(tight.size()) + tight + f32_bytes({42.0f}));
  EXPECT_EQ(io::SafetensorsFile(path).get("x").to_doubles(), (std::vector<double>{42.0}));
}

TEST(Safetensors, UnsupportedDTypeListsButRefusesToLoad) {
  TempDir dir;
  const std::string path = dir.file("bool.safetensors");
  write_raw(path, build_file(R"({"mask":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]},)"
                             R"("w":{"dtype":"F32","shape":[1],"data_offsets":[3,7]}})",
                             std::string("\x01\x00\x01", 3) + f32_bytes({2.0f})));
  io::SafetensorsFile file(path);
  EXPECT_TRUE(file.contains("mask"));
  EXPECT_EQ(file.info("mask").dtype, std::nullopt);
  EXPECT_EQ(file.info("mask").dtype_code, "BOOL");
  EXPECT_EQ(file.get("w").to_doubles(), (std::vector<double>{2.0}));
  try {
    file.get("mask");
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'mask'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("BOOL"), std::string::npos) << e.what();
  }
  try {
    file.get("absent");
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'absent'"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, EveryTruncationIsRejected) {
  TempDir dir;
  const std::string good = io::serialize_safetensors(
      {{"a", pattern_tensor({3, 2}, DType::F32, 1)}, {"b", pattern_tensor({5}, DType::BF16, 2)}}, {{"k", "v"}});
  const std::string path = dir.file("cut.safetensors");
  for (size_t length = 0; length < good.size(); ++length) {
    write_raw(path, good.substr(0, length));
    EXPECT_THROW(io::SafetensorsFile{path}, Error) << "accepted the first " << length << " of " << good.size()
                                                   << " bytes";
  }
  write_raw(path, good);
  EXPECT_NO_THROW(io::SafetensorsFile{path});
}

TEST(Safetensors, MalformedFilesAreRejectedWithClearErrors) {
  TempDir dir;
  const std::string ok_entry = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string data8 = f32_bytes({1, 2});
  auto with = [&](const std::string& entries, const std::string& data) { return build_file("{" + entries + "}", data); };

  expect_rejected(dir, "abc", "shorter than the 8-byte");
  expect_rejected(dir, "", "shorter than the 8-byte");
  // Header length flipped to absurd values, beyond the file, or zero.
  std::string good = with(ok_entry, data8);
  std::string flipped = good;
  flipped[7] = '\x7F';
  expect_rejected(dir, flipped, "absurd");
  flipped = good;
  flipped.replace(0, 8, le64(good.size()));
  expect_rejected(dir, flipped, "exceeds");
  flipped.replace(0, 8, le64(0));
  expect_rejected(dir, flipped, "too short");

  expect_rejected(dir, build_file("{not json", ""), "not valid JSON");
  expect_rejected(dir, build_file("[1, 2]", ""), "must be a JSON object");
  expect_rejected(dir, build_file("{\"w\":{}} trailing", ""), "not valid JSON");
  expect_rejected(dir, with(R"("w":[1])", ""), "must be a JSON object");
  expect_rejected(dir, with(R"("w":{"shape":[2],"data_offsets":[0,8]})", data8), "no \"dtype\"");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","data_offsets":[0,8]})", data8), "no \"shape\"");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","shape":[2]})", data8), "no \"data_offsets\"");
  expect_rejected(dir, with(R"("w":{"dtype":5,"shape":[2],"data_offsets":[0,8]})", data8), "must be a string");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","shape":"2","data_offsets":[0,8]})", data8), "array of integers");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})", data8), "must hold integers");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0]})", data8), "[begin, end]");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","shape":[2],"data_offsets":["0","8"]})", data8),
                  "two non-negative integers");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]})", data8),
                  "two non-negative integers");
  expect_rejected(dir, with(R"("w":{"dtype":"F128","shape":[2],"data_offsets":[0,8]})", data8), "unknown dtype");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","shape":[-2, -1],"data_offsets":[0,8]})", data8),
                  "negative or too large");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]})", data8), "end before");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]})", data8), "beyond the data");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]})", data8), "needs 12 bytes");
  expect_rejected(dir, with(R"("w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]})", data8),
                  "too many elements");
  expect_rejected(dir,
                  with(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]})",
                       f32_bytes({1, 2, 3})),
                  "overlap");
  expect_rejected(dir,
                  with(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]})",
                       f32_bytes({1, 2, 3, 4})),
                  "repeats the key 'a'");
  expect_rejected(dir, with(R"("__metadata__":{"n":1},)" + ok_entry, data8), "must be a string");
  expect_rejected(dir, with(R"("__metadata__":["x"],)" + ok_entry, data8), "must be an object of strings");
  expect_rejected(dir, with(R"("__metadata__":{"k":"a","k":"b"},)" + ok_entry, data8), "repeats the key 'k'");
}

TEST(Safetensors, GapsAndZeroSizedTensorsAreAccepted) {
  TempDir dir;
  const std::string path = dir.file("gap.safetensors");
  // [0, 4) and [8, 12) leave a 4-byte gap; two empty tensors sit at offset 4; 4 bytes trail.
  write_raw(path, build_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                             R"("e1":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                             R"("e2":{"dtype":"I64","shape":[2,0],"data_offsets":[4,4]},)"
                             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                             f32_bytes({1, 99, 2, 77})));
  io::SafetensorsFile file(path);
  EXPECT_EQ(file.get("a").to_doubles(), (std::vector<double>{1}));
  EXPECT_EQ(file.get("b").to_doubles(), (std::vector<double>{2}));
  EXPECT_EQ(file.get("e2").shape(), (Shape{2, 0}));
}

TEST(Safetensors, OpeningMissingFilesAndDirectoriesFails) {
  TempDir dir;
  EXPECT_THROW(io::SafetensorsFile(dir.file("absent.safetensors")), Error);
  EXPECT_THROW(io::SafetensorsFile(dir.path.string()), Error);
}

TEST(Safetensors, WriterRejectsBadInputAndKeepsTheOldFile) {
  TempDir dir;
  const std::string path = dir.file("keep.safetensors");
  const Tensor w = pattern_tensor({2}, DType::F32, 1);
  io::save_safetensors(path, {{"w", w}});
  const std::string before = io::read_file(path);
  EXPECT_THROW(io::save_safetensors(path, {{"w", w}, {"w", w}}), Error);
  EXPECT_THROW(io::save_safetensors(path, {{"w", w}, {"u", Tensor()}}), Error);
  EXPECT_THROW(io::save_safetensors(path, {{"__metadata__", w}}), Error);
  EXPECT_THROW(io::save_safetensors(path, {{"", w}}), Error);
  EXPECT_THROW(io::save_safetensors(path, {{"w", w}}, {{"bad", "\xFF\xFE"}}), Error);
  EXPECT_THROW(io::save_safetensors(path, {{"\xC3", w}}), Error);
  EXPECT_EQ(io::read_file(path), before);
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"keep.safetensors"}));
  EXPECT_THROW(io::save_safetensors(dir.file("no/such/dir/x.safetensors"), {{"w", w}}), Error);
}
