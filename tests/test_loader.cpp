// Tests of DataLoader: windows and the one-token shift, the train/validation split, the
// per-epoch order, save/restore of the position, and errors.
//
// The token files hold token i at position i, so a batch shows exactly where it was read.
#include "tessera/data/loader.h"

#include <numeric>
#include <set>

#include "data_testing.h"

using namespace tessera;
using namespace tessera::data;
using namespace tessera::testing;

namespace {

TokenFile positional_file(const TempDir& dir, int64_t n, const std::string& name = "tokens.bin") {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  std::iota(tokens.begin(), tokens.end(), 0);
  write_llmc_shard(dir.file(name), tokens);
  return TokenFile::open(dir.file(name));
}

LoaderOptions options(int64_t B, int64_t T, uint64_t seed = 1) {
  LoaderOptions o;
  o.batch_size = B;
  o.seq_len = T;
  o.seed = seed;
  return o;
}

// The first token of each row of a batch (checks every row is a window with its shift).
std::vector<int64_t> row_starts(const Batch& batch) {
  const int64_t B = batch.inputs.size(0), T = batch.inputs.size(1);
  const std::vector<int64_t> in = batch.inputs.to_ints(), out = batch.targets.to_ints();
  std::vector<int64_t> starts;
  for (int64_t b = 0; b < B; ++b) {
    starts.push_back(in[b * T]);
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(in[b * T + t], in[b * T] + t) << "row " << b << " is not a contiguous window";
      EXPECT_EQ(out[b * T + t], in[b * T + t] + 1) << "targets are not inputs shifted by one";
    }
  }
  return starts;
}

}  // namespace

TEST(DataLoader, BatchesAreShiftedWindows) {
  TempDir dir;
  DataLoader loader(positional_file(dir, 1000), options(4, 16));
  EXPECT_EQ(loader.num_windows(), (1000 - 1) / 16);  // 62
  EXPECT_EQ(loader.batches_per_epoch(), 15);
  const Batch batch = loader.next();
  EXPECT_EQ(batch.inputs.dtype(), DType::I32);
  EXPECT_EQ(batch.targets.shape(), (Shape{4, 16}));
  for (int64_t start : row_starts(batch)) {
    EXPECT_EQ(start % 16, 0) << "windows start on multiples of T";
    EXPECT_LE(start + 16, 999) << "the last target is inside the file";
  }
  EXPECT_EQ(loader.position(), (LoaderPosition{0, 1}));
}

TEST(DataLoader, AnEpochVisitsDistinctWindows) {
  TempDir dir;
  DataLoader loader(positional_file(dir, 1000), options(4, 16));
  std::set<int64_t> seen;
  for (int64_t k = 0; k < loader.batches_per_epoch(); ++k) {
    for (int64_t s : row_starts(loader.next())) EXPECT_TRUE(seen.insert(s).second) << "window " << s << " twice";
  }
  EXPECT_EQ(seen.size(), 60u);  // 62 windows, 2 left over this epoch
  EXPECT_EQ(loader.position(), (LoaderPosition{1, 0}));
  // The next epoch has another order.
  std::vector<int64_t> epoch0, epoch1;
  for (int64_t k = 0; k < 3; ++k) {
    const auto a = row_starts(loader.next());
    epoch1.insert(epoch1.end(), a.begin(), a.end());
  }
  for (int64_t k = 0; k < 3; ++k) {
    for (int64_t r = 0; r < 4; ++r) epoch0.push_back(loader.window_start(0, k, r));
  }
  EXPECT_NE(epoch0, epoch1);
}

TEST(DataLoader, WithoutShuffleWindowsComeInFileOrder) {
  TempDir dir;
  LoaderOptions o = options(2, 10);
  o.shuffle = false;
  DataLoader loader(positional_file(dir, 101), o);
  EXPECT_EQ(loader.batches_per_epoch(), 5);
  EXPECT_EQ(row_starts(loader.next()), (std::vector<int64_t>{0, 10}));
  EXPECT_EQ(row_starts(loader.next()), (std::vector<int64_t>{20, 30}));
}

TEST(DataLoader, ExactlyOneBatchOfTokensIsEnough) {
  TempDir dir;
  LoaderOptions o = options(3, 5);
  DataLoader loader(positional_file(dir, 16), o);  // B*T + 1
  EXPECT_EQ(loader.batches_per_epoch(), 1);
  std::vector<int64_t> starts = row_starts(loader.next());
  std::sort(starts.begin(), starts.end());
  EXPECT_EQ(starts, (std::vector<int64_t>{0, 5, 10}));
  EXPECT_EQ(loader.position(), (LoaderPosition{1, 0}));
  loader.next();  // epochs go on
  EXPECT_EQ(loader.position(), (LoaderPosition{2, 0}));
}

TEST(DataLoader, SameSeedSameBatchesOtherSeedOtherOrder) {
  TempDir dir;
  const TokenFile file = positional_file(dir, 5000);
  DataLoader a(file, options(4, 32, 7)), b(file, options(4, 32, 7)), c(file, options(4, 32, 8));
  bool all_same_as_c = true;
  for (int k = 0; k < 20; ++k) {
    const Batch x = a.next(), y = b.next(), z = c.next();
    EXPECT_EQ(x.inputs.to_ints(), y.inputs.to_ints());
    EXPECT_EQ(x.targets.to_ints(), y.targets.to_ints());
    all_same_as_c = all_same_as_c && x.inputs.to_ints() == z.inputs.to_ints();
  }
  EXPECT_FALSE(all_same_as_c);
}

TEST(DataLoader, RestoredPositionGivesIdenticalNextBatches) {
  TempDir dir;
  const TokenFile file = positional_file(dir, 3000);
  LoaderOptions o = options(3, 20, 42);
  o.val_fraction = 0.1;
  DataLoader original(file, o);
  const int64_t per_epoch = original.batches_per_epoch();
  for (int64_t k = 0; k < per_epoch - 2; ++k) original.next();  // close to an epoch's end
  const std::string saved = original.state().dump();

  DataLoader resumed(TokenFile::open(dir.file("tokens.bin")), o);
  resumed.load_state(nlohmann::json::parse(saved));
  EXPECT_EQ(resumed.position(), original.position());
  for (int k = 0; k < 6; ++k) {  // across the epoch boundary
    const Batch x = original.next(), y = resumed.next();
    EXPECT_EQ(x.inputs.to_ints(), y.inputs.to_ints()) << "batch " << k;
    EXPECT_EQ(x.targets.to_ints(), y.targets.to_ints()) << "batch " << k;
  }
  EXPECT_EQ(original.position(), resumed.position());
  EXPECT_EQ(original.position().epoch, 1);

  // The bare position round-trips through JSON too.
  const LoaderPosition p{3, 4};
  EXPECT_EQ(LoaderPosition::from_json(nlohmann::json::parse(p.to_json().dump())), p);
}

TEST(DataLoader, RestoreRejectsOtherSettingsAndBadPositions) {
  TempDir dir;
  const TokenFile file = positional_file(dir, 3000);
  DataLoader loader(file, options(3, 20, 42));
  loader.next();
  const nlohmann::json state = loader.state();
  DataLoader other_batch(file, options(4, 20, 42));
  expect_error([&] { other_batch.load_state(state); }, {"batch_size", "3", "4"});
  DataLoader other_seed(file, options(3, 20, 43));
  expect_error([&] { other_seed.load_state(state); }, {"seed"});
  LoaderOptions val = options(3, 20, 42);
  val.val_fraction = 0.5;
  DataLoader other_split(file, val);
  expect_error([&] { other_split.load_state(state); }, {"split_end"});

  nlohmann::json bad = state;
  bad.erase("epoch");
  expect_error([&] { loader.load_state(bad); }, {"'epoch'"});
  bad = state;
  bad["index"] = loader.batches_per_epoch();
  expect_error([&] { loader.load_state(bad); }, {"outside"});
  bad = state;
  bad["index"] = "1";
  expect_error([&] { loader.load_state(bad); }, {"'index' must be an integer"});
  expect_error([&] { loader.set_position({-1, 0}); }, {"epoch -1"});
  expect_error([&] { LoaderPosition::from_json(nlohmann::json::array()); }, {"JSON object"});
}

TEST(DataLoader, ValidationSplitIsTheDisjointTail) {
  TempDir dir;
  const TokenFile file = positional_file(dir, 2000);
  LoaderOptions o = options(2, 10);
  o.val_fraction = 0.25;
  DataLoader train(file, o);
  o.split = Split::Validation;
  o.shuffle = false;
  DataLoader val(file, o);
  EXPECT_EQ(train.split_begin(), 0);
  EXPECT_EQ(train.split_end(), 1500);
  EXPECT_EQ(val.split_begin(), 1500);
  EXPECT_EQ(val.split_end(), 2000);
  int64_t train_max = 0, val_min = 1 << 30, val_max = 0;
  for (int64_t k = 0; k < train.batches_per_epoch(); ++k) {
    const Batch b = train.next();
    for (int64_t t : b.targets.to_ints()) train_max = std::max(train_max, t);  // targets reach furthest
  }
  for (int64_t k = 0; k < val.batches_per_epoch(); ++k) {
    const Batch b = val.next();
    for (int64_t t : b.inputs.to_ints()) val_min = std::min(val_min, t);
    for (int64_t t : b.targets.to_ints()) val_max = std::max(val_max, t);
  }
  EXPECT_LT(train_max, 1500);
  EXPECT_EQ(val_min, 1500);
  EXPECT_LE(val_max, 1999);
  EXPECT_EQ(val.position(), (LoaderPosition{1, 0}));  // a full pass over validation ends the epoch
}

TEST(DataLoader, TooShortSplitSaysHowManyTokens) {
  TempDir dir;
  const TokenFile file = positional_file(dir, 100);
  expect_error([&] { DataLoader(file, options(4, 25)); }, {"100 tokens", "B*T+1 = 101", "train"});
  LoaderOptions o = options(2, 10);
  o.val_fraction = 0.1;  // 10 validation tokens
  o.split = Split::Validation;
  expect_error([&] { DataLoader(file, o); }, {"validation split", "10 tokens", "21"});
  o.val_fraction = 0.0;
  expect_error([&] { DataLoader(file, o); }, {"validation split", "empty"});
  o.val_fraction = 1.0;
  expect_error([&] { DataLoader(file, o); }, {"val_fraction"});
  expect_error([&] { DataLoader(file, options(0, 10)); }, {"B=0"});
  expect_error([&] { DataLoader(file, options(1, 0)); }, {"T=0"});
}

TEST(DataLoader, CorruptFilesAreErrors) {
  TempDir dir;
  positional_file(dir, 500);
  const std::string bytes = read_text_file(dir.file("tokens.bin"));
  write_text_file(dir.file("cut.bin"), bytes.substr(0, bytes.size() - 10));
  expect_error([&] { DataLoader(TokenFile::open(dir.file("cut.bin")), options(2, 8)); }, {"cut.bin", "truncated"});
  std::string bad = bytes;
  bad[1] ^= 0x01;
  write_text_file(dir.file("magic.bin"), bad);
  expect_error([&] { DataLoader(TokenFile::open(dir.file("magic.bin")), options(2, 8)); },
               {"magic.bin", "neither an llm.c shard"});
}

TEST(DataLoader, PreallocatedOutputsAndVocabularyCheck) {
  TempDir dir;
  const TokenFile file = positional_file(dir, 500);
  LoaderOptions o = options(2, 8);
  o.shuffle = false;
  DataLoader loader(file, o);
  Tensor inputs = Tensor::empty({2, 8}, DType::I32), targets = Tensor::empty({2, 8}, DType::I32);
  loader.next(inputs, targets);
  EXPECT_EQ(inputs.item(8), 8.0);
  EXPECT_EQ(targets.item(15), 16.0);
  Tensor wrong_shape = Tensor::empty({2, 9}, DType::I32), wrong_dtype = Tensor::empty({2, 8}, DType::I64);
  expect_error([&] { loader.next(wrong_shape, targets); }, {"inputs", "[2, 9]"});
  expect_error([&] { loader.next(inputs, wrong_dtype); }, {"targets", "i64"});
  Tensor undefined;
  expect_error([&] { loader.next(undefined, targets); }, {"inputs"});

  o.vocab_size = 100;
  DataLoader checked(file, o);
  for (int k = 0; k < 6; ++k) checked.next();  // tokens 0..96
  expect_error([&] { checked.next(); }, {"token 100", "vocabulary [0, 100)"});
}

TEST(DataLoader, ReadsMegatronDatasetsAsOneStream) {
  TempDir dir;
  IndexedDatasetWriter w(dir.file("mega"), IndexedDType::U16);
  std::vector<int32_t> doc(37);
  for (int d = 0; d < 10; ++d) {
    std::iota(doc.begin(), doc.end(), d * 37);
    w.add_document(doc);
  }
  w.finalize();
  LoaderOptions o = options(4, 9);
  DataLoader loader(TokenFile::open(dir.file("mega")), o);
  EXPECT_EQ(loader.num_windows(), (370 - 1) / 9);
  for (int k = 0; k < 12; ++k) row_starts(loader.next());  // windows cross document boundaries
}
