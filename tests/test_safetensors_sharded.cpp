// Sharded checkpoints: Hugging Face shard names and index, greedy splitting, reading across
// shards, stale files of an older checkpoint removed, and malformed indexes rejected.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "io_testing.h"
#include "tessera/io/atomic_file.h"
#include "tessera/io/safetensors.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// a, b: 40 bytes; big: 400; c: 40; d: 8; e: 0; f: 40.
io::NamedTensors example_tensors() {
  return {{"a", pattern_tensor({10}, DType::F32, 1)},        {"b", pattern_tensor({2, 5}, DType::F32, 2)},
          {"big", pattern_tensor({200}, DType::BF16, 3)},    {"c", pattern_tensor({5, 2}, DType::F32, 4)},
          {"d", pattern_tensor({}, DType::I64, 5)},          {"e", pattern_tensor({0, 3}, DType::U8, 6)},
          {"f", pattern_tensor({40}, DType::E4M3, 7)}};
}

void expect_same_tensors(const io::CheckpointReader& reader, const io::NamedTensors& tensors) {
  std::vector<std::string> names;
  for (const auto& [name, t] : tensors) {
    names.push_back(name);
    ASSERT_TRUE(reader.contains(name)) << name;
    const Tensor back = reader.get(name);
    EXPECT_EQ(back.shape(), t.shape()) << name;
    EXPECT_EQ(back.dtype(), t.dtype()) << name;
    EXPECT_EQ(bytes_of(back), bytes_of(t)) << name;
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(reader.names(), names);
}

}  // namespace

TEST(SafetensorsSharded, ShardNames) {
  EXPECT_EQ(io::shard_file_name(0, 3), "model-00001-of-00003.safetensors");
  EXPECT_EQ(io::shard_file_name(11, 12), "model-00012-of-00012.safetensors");
  EXPECT_THROW(io::shard_file_name(3, 3), Error);
  EXPECT_THROW(io::shard_file_name(0, 0), Error);
}

TEST(SafetensorsSharded, SplitsGreedilyAndWritesTheIndex) {
  TempDir dir;
  const io::NamedTensors tensors = example_tensors();
  io::save_sharded(dir.path.string(), tensors, 100);
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"model-00001-of-00003.safetensors",
                                                     "model-00002-of-00003.safetensors",
                                                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"}));

  const nlohmann::json index = nlohmann::json::parse(io::read_file(dir.file("model.safetensors.index.json")));
  EXPECT_EQ(index["metadata"]["total_size"], 40 + 40 + 400 + 40 + 8 + 0 + 40);
  const nlohmann::json want_map = {{"a", "model-00001-of-00003.safetensors"}, {"b", "model-00001-of-00003.safetensors"},
                                   {"big", "model-00002-of-00003.safetensors"}, {"c", "model-00003-of-00003.safetensors"},
                                   {"d", "model-00003-of-00003.safetensors"},  {"e", "model-00003-of-00003.safetensors"},
                                   {"f", "model-00003-of-00003.safetensors"}};
  EXPECT_EQ(index["weight_map"], want_map);

  const io::ShardIndex loaded = io::load_index(dir.path.string());
  EXPECT_EQ(loaded.metadata.at("total_size"), "568");
  EXPECT_EQ(loaded.weight_map.size(), 7u);
  EXPECT_EQ(loaded.shard_files().size(), 3u);

  io::SafetensorsFile shard(dir.file("model-00001-of-00003.safetensors"));
  EXPECT_EQ(shard.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(shard.metadata().at("format"), "pt");

  io::CheckpointReader reader(dir.path.string());
  EXPECT_TRUE(reader.sharded());
  EXPECT_EQ(reader.num_files(), 3u);
  EXPECT_EQ(reader.metadata().at("total_size"), "568");
  EXPECT_EQ(reader.info("big").shape, (Shape{200}));
  EXPECT_EQ(reader.file_of("c").path(), dir.file("model-00003-of-00003.safetensors"));
  expect_same_tensors(reader, tensors);
  Tensor dst = Tensor::zeros({2, 5}, DType::F32);
  reader.read_into("b", dst);
  EXPECT_EQ(bytes_of(dst), bytes_of(tensors[1].second));
  EXPECT_THROW(reader.get("absent"), Error);
  EXPECT_THROW(reader.info("absent"), Error);
}

TEST(SafetensorsSharded, OneShardIsAPlainFileAndStaleFilesGo) {
  TempDir dir;
  const io::NamedTensors tensors = example_tensors();
  io::write_file_atomically(dir.file("notes.txt"), std::string_view("keep me"));
  io::write_file_atomically(dir.file("model-extra.safetensors"), std::string_view("not ours"));

  io::save_sharded(dir.path.string(), tensors, 100);
  ASSERT_EQ(dir.entries().size(), 6u);

  // Everything fits: a single model.safetensors, and the shards and index of before are gone.
  io::save_sharded(dir.path.string(), tensors);
  EXPECT_EQ(dir.entries(),
            (std::vector<std::string>{"model-extra.safetensors", "model.safetensors", "notes.txt"}));
  io::CheckpointReader single(dir.path.string());
  EXPECT_FALSE(single.sharded());
  EXPECT_EQ(single.metadata().at("format"), "pt");
  expect_same_tensors(single, tensors);

  // Back to shards (two this time): the stale model.safetensors, which readers prefer, goes.
  io::save_sharded(dir.path.string(), tensors, 500);
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors", "model-extra.safetensors",
                                                     "model.safetensors.index.json", "notes.txt"}));
  expect_same_tensors(io::CheckpointReader(dir.path.string()), tensors);
  EXPECT_EQ(io::read_file(dir.file("notes.txt")), "keep me");

  // A .safetensors path reads as a one-file checkpoint.
  io::CheckpointReader one(dir.file("model-00002-of-00002.safetensors"));
  EXPECT_FALSE(one.sharded());
  EXPECT_TRUE(one.contains("f"));
}

TEST(SafetensorsSharded, EmptyAndNonContiguousTensors) {
  TempDir dir;
  io::save_sharded(dir.path.string(), {}, 100);
  EXPECT_EQ(io::CheckpointReader(dir.path.string()).names().size(), 0u);

  const Tensor base = pattern_tensor({8, 6}, DType::F64, 3);
  const io::NamedTensors views = {{"t", base.transpose(0, 1)}, {"s", base.slice(1, 1, 4)}, {"r", base.select(0, 5)}};
  io::save_sharded(dir.path.string(), views, 200);
  io::CheckpointReader reader(dir.path.string());
  EXPECT_TRUE(reader.sharded());
  expect_same_tensors(reader, views);
}

TEST(SafetensorsSharded, WriterRejectsBadInput) {
  TempDir dir;
  const Tensor w = pattern_tensor({2}, DType::F32, 1);
  EXPECT_THROW(io::save_sharded(dir.file("missing"), {{"w", w}}, 100), Error);
  EXPECT_THROW(io::save_sharded(dir.path.string(), {{"w", w}}, 0), Error);
  // Duplicates in different shards are caught before anything is written.
  EXPECT_THROW(io::save_sharded(dir.path.string(), {{"w", w}, {"v", w}, {"w", w}}, 8), Error);
  EXPECT_THROW(io::save_sharded(dir.path.string(), {{"w", w}, {"u", Tensor()}}, 8), Error);
  EXPECT_TRUE(dir.entries().empty());
}

TEST(SafetensorsSharded, MalformedIndexesAreRejected) {
  TempDir dir;
  const std::string d = dir.path.string();
  EXPECT_THROW(io::CheckpointReader{d}, Error);  // neither file
  EXPECT_THROW(io::load_index(d), Error);
  EXPECT_THROW(io::CheckpointReader{dir.file("nowhere")}, Error);

  io::save_safetensors(dir.file("shard-a.safetensors"), {{"x", pattern_tensor({2}, DType::F32, 1)}});
  auto expect_bad_index = [&](const std::string& text, const std::string& words) {
    io::write_file_atomically(dir.file("model.safetensors.index.json"), text);
    try {
      io::CheckpointReader reader(d);
      ADD_FAILURE() << "accepted index " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expect_bad_index("{nope", "not valid JSON");
  expect_bad_index("[]", "must hold a JSON object");
  expect_bad_index(R"({"metadata": {}})", "no object \"weight_map\"");
  expect_bad_index(R"({"weight_map": {"x": 3}})", "must name a shard file");
  expect_bad_index(R"({"metadata": 3, "weight_map": {}})", "\"metadata\" must be an object");
  expect_bad_index(R"({"weight_map": {"x": "../shard-a.safetensors"}})", "not a file inside");
  expect_bad_index(R"({"weight_map": {"x": "/etc/passwd"}})", "not a file inside");
  expect_bad_index(R"({"weight_map": {"x": "missing.safetensors"}})", "does not exist");
  expect_bad_index(R"({"weight_map": {"y": "shard-a.safetensors"}})", "has no such tensor");

  io::write_file_atomically(dir.file("model.safetensors.index.json"),
                            std::string_view(R"({"metadata": {"total_size": 8, "note": "hi"},)"
                                             R"( "weight_map": {"x": "shard-a.safetensors"}})"));
  io::CheckpointReader reader(d);
  EXPECT_EQ(reader.metadata().at("total_size"), "8");
  EXPECT_EQ(reader.metadata().at("note"), "hi");
  EXPECT_EQ(reader.get("x").numel(), 2);

  // A corrupt shard is reported when the checkpoint is opened, not at first use.
  write_raw(dir.file("shard-a.safetensors"), "garbage!");
  EXPECT_THROW(io::CheckpointReader{d}, Error);
}
