// Tests of the token files: llm.c shards, Megatron-LM indexed datasets and TokenFile.
#include "tessera/data/token_file.h"

#include <cstring>
#include <filesystem>
#include <numeric>

#include "data_testing.h"

using namespace tessera;
using namespace tessera::data;
using namespace tessera::testing;

namespace {

std::vector<int32_t> iota_tokens(int64_t n, int32_t first = 0) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

template <typename T>
void append_raw(std::string& bytes, T value) {
  bytes.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// Files in `dir` whose name holds ".tmp." (left-over temporaries of an atomic write).
int count_temporaries(const TempDir& dir) {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    n += entry.path().filename().string().find(".tmp.") != std::string::npos;
  }
  return n;
}

// A Megatron .idx built byte by byte from the format description, independent of the writer.
std::string megatron_index(uint8_t dtype_code, const std::vector<int32_t>& lengths, const std::vector<int64_t>& pointers,
                           const std::vector<int64_t>& documents) {
  std::string bytes("MMIDIDX\0\0", 9);
  append_raw<uint64_t>(bytes, 1);
  append_raw<uint8_t>(bytes, dtype_code);
  append_raw<uint64_t>(bytes, lengths.size());
  append_raw<uint64_t>(bytes, documents.size());
  for (int32_t x : lengths) append_raw(bytes, x);
  for (int64_t x : pointers) append_raw(bytes, x);
  for (int64_t x : documents) append_raw(bytes, x);
  return bytes;
}

}  // namespace

// ---- llm.c shards ----------------------------------------------------------------------

TEST(LlmcShard, WritesTheLlmcLayout) {
  TempDir dir;
  const std::string path = dir.file("shard.bin");
  write_llmc_shard(path, std::vector<int32_t>{1, 65535, 50256});
  const std::string bytes = read_text_file(path);
  ASSERT_EQ(bytes.size(), 1024u + 3 * 2);
  int32_t header[256];
  std::memcpy(header, bytes.data(), sizeof(header));
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 3);
  for (int i = 3; i < 256; ++i) ASSERT_EQ(header[i], 0);
  uint16_t tokens[3];
  std::memcpy(tokens, bytes.data() + 1024, sizeof(tokens));
  EXPECT_EQ(tokens[0], 1);
  EXPECT_EQ(tokens[1], 65535);
  EXPECT_EQ(tokens[2], 50256);
  EXPECT_EQ(count_temporaries(dir), 0);
}

TEST(LlmcShard, RoundTripsBothFormats) {
  TempDir dir;
  const std::vector<int32_t> gpt2 = iota_tokens(70000, 0);  // wraps past 65535 below
  std::vector<int32_t> small(gpt2.begin(), gpt2.begin() + 65536);
  write_llmc_shard(dir.file("g.bin"), small);
  LlmcShard g = LlmcShard::open(dir.file("g.bin"));
  EXPECT_EQ(g.format(), LlmcFormat::Gpt2);
  EXPECT_EQ(g.num_tokens(), 65536);
  EXPECT_EQ(g.read_tokens(65530, 6), std::vector<int32_t>(small.end() - 6, small.end()));
  EXPECT_EQ(g.read_tokens(0, 0), std::vector<int32_t>{});

  const std::vector<int32_t> big = {0, 128000, 2147483647, 7};
  write_llmc_shard(dir.file("l.bin"), big, LlmcFormat::Llama3);
  LlmcShard l = LlmcShard::open(dir.file("l.bin"));
  EXPECT_EQ(l.format(), LlmcFormat::Llama3);
  EXPECT_EQ(read_text_file(dir.file("l.bin")).size(), 1024u + 4 * 4);
  EXPECT_EQ(l.read_tokens(0, 4), big);

  write_llmc_shard(dir.file("empty.bin"), std::vector<int32_t>{});
  EXPECT_EQ(LlmcShard::open(dir.file("empty.bin")).num_tokens(), 0);
}

TEST(LlmcShard, WriterRejectsTokensThatDoNotFit) {
  TempDir dir;
  const std::string path = dir.file("s.bin");
  write_llmc_shard(path, std::vector<int32_t>{1, 2, 3});
  expect_error([&] { write_llmc_shard(path, std::vector<int32_t>{1, 65536}); }, {"65536", "position 1", "GPT-2"});
  expect_error([&] { write_llmc_shard(path, std::vector<int32_t>{-1}, LlmcFormat::Llama3); }, {"-1"});
  // A failed write leaves the old file whole and no temporary behind.
  EXPECT_EQ(LlmcShard::open(path).read_tokens(0, 3), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(count_temporaries(dir), 0);
  // A successful write replaces it.
  write_llmc_shard(path, std::vector<int32_t>{9});
  EXPECT_EQ(LlmcShard::open(path).read_tokens(0, 1), std::vector<int32_t>{9});
}

TEST(LlmcShard, ReadOutsideTheFileIsAnError) {
  TempDir dir;
  write_llmc_shard(dir.file("s.bin"), iota_tokens(10));
  LlmcShard s = LlmcShard::open(dir.file("s.bin"));
  expect_error([&] { s.read_tokens(8, 3); }, {"[8, 11)", "10 tokens"});
  expect_error([&] { s.read_tokens(-1, 1); }, {"outside"});
}

TEST(LlmcShard, ValidationErrors) {
  TempDir dir;
  const std::string good = dir.file("good.bin");
  write_llmc_shard(good, iota_tokens(100));
  const std::string bytes = read_text_file(good);

  expect_error([&] { LlmcShard::open(dir.file("missing.bin")); }, {"missing.bin", "cannot open"});
  write_text_file(dir.file("short.bin"), bytes.substr(0, 500));
  expect_error([&] { LlmcShard::open(dir.file("short.bin")); }, {"truncated", "500 bytes"});
  write_text_file(dir.file("empty.bin"), "");
  expect_error([&] { LlmcShard::open(dir.file("empty.bin")); }, {"truncated", "0 bytes"});

  std::string bad_magic = bytes;
  bad_magic[0] ^= 0x5A;
  write_text_file(dir.file("magic.bin"), bad_magic);
  expect_error([&] { LlmcShard::open(dir.file("magic.bin")); }, {"bad magic", "20240520"});

  std::string bad_version = bytes;
  bad_version[4] = 2;
  write_text_file(dir.file("version.bin"), bad_version);
  expect_error([&] { LlmcShard::open(dir.file("version.bin")); }, {"version 2"});

  write_text_file(dir.file("cut.bin"), bytes.substr(0, bytes.size() - 1));
  expect_error([&] { LlmcShard::open(dir.file("cut.bin")); }, {"100 tokens", "truncated"});
  write_text_file(dir.file("long.bin"), bytes + "xx");
  expect_error([&] { LlmcShard::open(dir.file("long.bin")); }, {"trailing bytes"});

  std::string negative = bytes;
  const int32_t minus_one = -1;
  std::memcpy(negative.data() + 8, &minus_one, 4);
  write_text_file(dir.file("negative.bin"), negative);
  expect_error([&] { LlmcShard::open(dir.file("negative.bin")); }, {"negative token count"});

  expect_error([&] { LlmcShard::open(dir.path().string()); }, {"directory"});
}

// ---- Megatron indexed datasets ---------------------------------------------------------

TEST(IndexedDataset, WriterProducesMegatronLayout) {
  TempDir dir;
  const std::string prefix = dir.file("ds");
  {
    IndexedDatasetWriter w(prefix, IndexedDType::U16);
    w.add_document(std::vector<int32_t>{10, 11, 12});
    w.add_sequence(std::vector<int32_t>{20});
    w.add_sequence(std::vector<int32_t>{21, 22});
    w.end_document();
    w.add_sequence(std::vector<int32_t>{});  // finalize closes this open document
    w.finalize();
  }
  EXPECT_EQ(read_text_file(prefix + ".idx"), megatron_index(8, {3, 1, 2, 0}, {0, 6, 8, 12}, {0, 1, 3, 4}));
  std::string expected_bin;
  for (uint16_t t : {10, 11, 12, 20, 21, 22}) append_raw(expected_bin, t);
  EXPECT_EQ(read_text_file(prefix + ".bin"), expected_bin);
  EXPECT_EQ(count_temporaries(dir), 0);

  IndexedDataset ds = IndexedDataset::open(prefix);
  EXPECT_EQ(ds.dtype(), IndexedDType::U16);
  EXPECT_EQ(ds.num_sequences(), 4);
  EXPECT_EQ(ds.num_documents(), 3);
  EXPECT_EQ(ds.num_tokens(), 6);
  EXPECT_EQ(ds.document_indices(), (std::vector<int64_t>{0, 1, 3, 4}));
  EXPECT_EQ(ds.sequence(0), (std::vector<int32_t>{10, 11, 12}));
  EXPECT_EQ(ds.sequence(2), (std::vector<int32_t>{21, 22}));
  EXPECT_EQ(ds.sequence(3), std::vector<int32_t>{});
  EXPECT_EQ(ds.sequence_pointer(2), 8);
  std::vector<int32_t> part(2);
  ds.read_sequence(0, 1, part);
  EXPECT_EQ(part, (std::vector<int32_t>{11, 12}));
  std::vector<int32_t> flat(4);
  ds.read_tokens(2, flat);
  EXPECT_EQ(flat, (std::vector<int32_t>{12, 20, 21, 22}));
  expect_error([&] { ds.sequence(4); }, {"sequence 4", "[0, 4)"});
  expect_error([&] { ds.read_sequence(0, 2, part); }, {"[2, 4)", "3 tokens"});
}

TEST(IndexedDataset, EveryDTypeRoundTrips) {
  TempDir dir;
  const std::vector<std::pair<IndexedDType, std::vector<int32_t>>> cases = {
      {IndexedDType::U8, {0, 255, 7}},          {IndexedDType::I8, {-128, 127, 0}},
      {IndexedDType::I16, {-32768, 32767, 5}},  {IndexedDType::I32, {INT32_MIN, INT32_MAX, 0}},
      {IndexedDType::I64, {INT32_MIN, INT32_MAX, 3}}, {IndexedDType::F64, {-5, 1 << 30, 0}},
      {IndexedDType::F32, {-(1 << 24), 1 << 24, 9}}, {IndexedDType::U16, {0, 65535, 50256}},
  };
  for (const auto& [dtype, tokens] : cases) {
    const std::string prefix = dir.file(std::string("ds_") + indexed_dtype_name(dtype));
    IndexedDatasetWriter w(prefix, dtype);
    w.add_document(tokens);
    w.finalize();
    IndexedDataset ds = IndexedDataset::open(prefix);
    EXPECT_EQ(ds.dtype(), dtype);
    EXPECT_EQ(ds.sequence(0), tokens) << indexed_dtype_name(dtype);
    EXPECT_EQ(read_text_file(prefix + ".bin").size(), tokens.size() * indexed_dtype_size(dtype));
  }
  IndexedDatasetWriter w(dir.file("bad"), IndexedDType::U8);
  expect_error([&] { w.add_sequence(std::vector<int32_t>{1, 256}); }, {"256", "uint8"});
  IndexedDatasetWriter f(dir.file("badf"), IndexedDType::F32);
  expect_error([&] { f.add_sequence(std::vector<int32_t>{(1 << 24) + 1}); }, {"float32"});
}

TEST(IndexedDataset, ReadsHandBuiltFilesAndConvertsValues) {
  TempDir dir;
  // int64 tokens, sequences stored out of order in the .bin (not packed).
  std::string bin;
  for (int64_t t : {30, 31, 10, 11, 12}) append_raw(bin, t);
  write_text_file(dir.file("h.bin"), bin);
  write_text_file(dir.file("h.idx"), megatron_index(5, {3, 2}, {16, 0}, {0, 2}));
  IndexedDataset ds = IndexedDataset::open(dir.file("h"));
  EXPECT_EQ(ds.sequence(0), (std::vector<int32_t>{10, 11, 12}));
  EXPECT_EQ(ds.sequence(1), (std::vector<int32_t>{30, 31}));
  std::vector<int32_t> flat(4);
  ds.read_tokens(1, flat);
  EXPECT_EQ(flat, (std::vector<int32_t>{11, 12, 30, 31}));

  // Values that are not int32 token ids fail when read.
  std::string fbin;
  for (float t : {1.0f, 0.5f}) append_raw(fbin, t);
  write_text_file(dir.file("f.bin"), fbin);
  write_text_file(dir.file("f.idx"), megatron_index(7, {2}, {0}, {0, 1}));
  expect_error([&] { IndexedDataset::open(dir.file("f")).sequence(0); }, {"0.5", "not an int32"});
  std::string big;
  append_raw<int64_t>(big, int64_t{1} << 40);
  write_text_file(dir.file("b.bin"), big);
  write_text_file(dir.file("b.idx"), megatron_index(5, {1}, {0}, {0, 1}));
  expect_error([&] { IndexedDataset::open(dir.file("b")).sequence(0); }, {"outside the int32 range"});
  // Trailing bytes (Megatron's multimodal sequence modes) are allowed.
  write_text_file(dir.file("h.idx"), megatron_index(5, {3, 2}, {16, 0}, {0, 2}) + std::string(2, '\0'));
  EXPECT_EQ(IndexedDataset::open(dir.file("h")).num_tokens(), 5);
}

TEST(IndexedDataset, ValidationErrors) {
  TempDir dir;
  const std::string prefix = dir.file("ds");
  IndexedDatasetWriter w(prefix, IndexedDType::I32);
  w.add_document(iota_tokens(10));
  w.add_document(iota_tokens(5));
  w.finalize();
  const std::string idx = read_text_file(prefix + ".idx"), bin = read_text_file(prefix + ".bin");
  const auto with = [&](const std::string& new_idx, const std::string& new_bin) {
    write_text_file(prefix + ".idx", new_idx);
    write_text_file(prefix + ".bin", new_bin);
    return [prefix] { IndexedDataset::open(prefix); };
  };
  std::string bad = idx;
  bad[0] = 'X';
  expect_error(with(bad, bin), {"bad magic", "ds.idx"});
  bad = idx;
  bad[9] = 2;
  expect_error(with(bad, bin), {"version 2"});
  bad = idx;
  bad[17] = 9;
  expect_error(with(bad, bin), {"dtype code 9"});
  expect_error(with(idx.substr(0, 20), bin), {"truncated", "20 bytes"});
  expect_error(with(idx.substr(0, idx.size() - 1), bin), {"truncated", "2 sequences"});
  bad = idx;
  bad[18] = 100;  // sequence count
  expect_error(with(bad, bin), {"truncated", "100 sequences", "1258 bytes"});
  expect_error(with(idx, bin.substr(0, bin.size() - 4)), {"sequence 1", "past the end of the .bin"});
  bad = idx;
  const int64_t far = 1 << 20;
  std::memcpy(bad.data() + 34 + 2 * 4 + 8, &far, 8);  // pointer of sequence 1
  expect_error(with(bad, bin), {"sequence 1", "byte 1048576"});
  bad = idx;
  const int32_t negative = -3;
  std::memcpy(bad.data() + 34, &negative, 4);
  expect_error(with(bad, bin), {"length -3"});
  expect_error(with(megatron_index(4, {10, 5}, {0, 40}, {1, 2}), bin), {"start with 0"});
  expect_error(with(megatron_index(4, {10, 5}, {0, 40}, {0, 2, 1}), bin), {"non-decreasing"});
  expect_error(with(megatron_index(4, {10, 5}, {0, 40}, {0, 3}), bin), {"document index 1", "<= 2"});
  std::filesystem::remove(prefix + ".bin");
  expect_error([&] { IndexedDataset::open(prefix); }, {"ds.bin", "cannot open"});
}

TEST(IndexedDataset, UnfinalizedWriterLeavesNothing) {
  TempDir dir;
  {
    IndexedDatasetWriter w(dir.file("ds"), IndexedDType::U16);
    w.add_document(iota_tokens(100));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  IndexedDatasetWriter w(dir.file("ds2"));
  w.finalize();
  expect_error([&] { w.finalize(); }, {"twice"});
  expect_error([&] { w.add_sequence(std::vector<int32_t>{1}); }, {"after finalize"});
  EXPECT_EQ(IndexedDataset::open(dir.file("ds2")).num_sequences(), 0);
}

// ---- TokenFile ---------------------------------------------------------------------------

TEST(TokenFile, OpensEveryFormByPath) {
  TempDir dir;
  write_llmc_shard(dir.file("shard.bin"), iota_tokens(50));
  IndexedDatasetWriter w(dir.file("mega"), IndexedDType::I32);
  w.add_document(iota_tokens(30, 100));
  w.add_document(iota_tokens(20, 200));
  w.finalize();

  TokenFile shard = TokenFile::open(dir.file("shard.bin"));
  EXPECT_EQ(shard.num_tokens(), 50);
  EXPECT_EQ(shard.format(0), TokenFileFormat::LlmcShard);
  EXPECT_EQ(shard.read(48, 2), (std::vector<int32_t>{48, 49}));
  EXPECT_NE(shard.describe().find("GPT-2, 50 tokens"), std::string::npos) << shard.describe();

  for (const std::string& path : {dir.file("mega"), dir.file("mega.idx"), dir.file("mega.bin")}) {
    TokenFile mega = TokenFile::open(path);
    EXPECT_EQ(mega.format(0), TokenFileFormat::MegatronIndexed) << path;
    EXPECT_EQ(mega.num_tokens(), 50);
    EXPECT_EQ(mega.read(28, 4), (std::vector<int32_t>{128, 129, 200, 201}));
    EXPECT_NE(mega.describe().find("2 documents"), std::string::npos) << mega.describe();
  }
}

TEST(TokenFile, GlobConcatenatesInSortedOrder) {
  TempDir dir;
  write_llmc_shard(dir.file("train_001.bin"), iota_tokens(10, 10));
  write_llmc_shard(dir.file("train_000.bin"), iota_tokens(10, 0));
  write_llmc_shard(dir.file("train_002.bin"), std::vector<int32_t>{});  // empty shards are skipped over
  write_llmc_shard(dir.file("train_003.bin"), iota_tokens(5, 20), LlmcFormat::Llama3);
  TokenFile all = TokenFile::open(dir.file("train_*.bin"));
  EXPECT_EQ(all.num_files(), 4);
  EXPECT_EQ(all.num_tokens(), 25);
  EXPECT_EQ(all.read(0, 25), iota_tokens(25));
  EXPECT_EQ(all.read(9, 3), (std::vector<int32_t>{9, 10, 11}));
  EXPECT_EQ(all.read(20, 0), std::vector<int32_t>{});
  expect_error([&] { all.read(20, 6); }, {"[20, 26)", "25 tokens"});

  // A Megatron dataset matched by both its files counts once.
  IndexedDatasetWriter w(dir.file("mega"), IndexedDType::U16);
  w.add_document(iota_tokens(7));
  w.finalize();
  EXPECT_EQ(TokenFile::open(dir.file("meg*")).num_files(), 1);
  EXPECT_EQ(TokenFile::open(dir.file("meg*")).num_tokens(), 7);
}

TEST(TokenFile, OpenErrors) {
  TempDir dir;
  expect_error([&] { TokenFile::open(dir.file("nothing")); }, {"does not exist"});
  expect_error([&] { TokenFile::open(dir.file("nothing_*.bin")); }, {"matches no file"});
  write_text_file(dir.file("text.bin"), "hello, not tokens");
  expect_error([&] { TokenFile::open(dir.file("text.bin")); }, {"neither an llm.c shard", "text.bin"});
  write_llmc_shard(dir.file("s.bin"), iota_tokens(10));
  std::string cut = read_text_file(dir.file("s.bin"));
  write_text_file(dir.file("s.bin"), cut.substr(0, cut.size() - 2));
  expect_error([&] { TokenFile::open(dir.file("s.bin")); }, {"truncated"});
  expect_error([&] { TokenFile().num_tokens(); }, {"not opened"});
}
