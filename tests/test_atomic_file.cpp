// Crash-safe writes: a failing writer (exception, short write) leaves the old file intact and
// no temporary behind; reads report missing files and directories clearly.
#include "tessera/io/atomic_file.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <stdexcept>

#include "io_testing.h"
#include "tessera/core/error.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

void expect_only(const TempDir& dir, const std::vector<std::string>& names) {
  std::vector<std::string> want = names;
  std::sort(want.begin(), want.end());
  EXPECT_EQ(dir.entries(), want) << "leftover temporary files?";
}

struct CustomFailure : std::runtime_error {
  CustomFailure() : std::runtime_error("custom failure") {}
};

}  // namespace

TEST(AtomicFile, WritesAndReplaces) {
  TempDir dir;
  const std::string path = dir.file("a.txt");
  io::write_file_atomically(path, std::string_view("first"));
  EXPECT_EQ(io::read_file(path), "first");
  io::write_file_atomically(path, std::string_view("second, longer"));
  EXPECT_EQ(io::read_file(path), "second, longer");
  io::write_file_atomically(path, std::string_view(""));
  EXPECT_EQ(io::read_file(path), "");
  expect_only(dir, {"a.txt"});
}

TEST(AtomicFile, ThrowingWriterLeavesOldFileAndNoTemporary) {
  TempDir dir;
  const std::string path = dir.file("ckpt.bin");
  io::write_file_atomically(path, std::string_view("good old contents"));
  // The writer's own exception type comes through unchanged, after half the data went out.
  EXPECT_THROW(io::write_file_atomically(path,
                                         [&](std::FILE* f) {
                                           io::write_bytes(f, "partial new", 11, path);
                                           std::fflush(f);
                                           throw CustomFailure();
                                         }),
               CustomFailure);
  EXPECT_EQ(io::read_file(path), "good old contents");
  expect_only(dir, {"ckpt.bin"});
  // A tessera::Error inside the writer behaves the same.
  EXPECT_THROW(io::write_file_atomically(path, [&](std::FILE*) { TESSERA_FAIL("writer gave up"); }), Error);
  EXPECT_EQ(io::read_file(path), "good old contents");
  expect_only(dir, {"ckpt.bin"});
}

TEST(AtomicFile, ThrowingWriterCreatesNothingWhenThereWasNoFile) {
  TempDir dir;
  EXPECT_THROW(io::write_file_atomically(dir.file("new.bin"), [](std::FILE*) { throw CustomFailure(); }),
               CustomFailure);
  expect_only(dir, {});
}

// A file-size limit makes the kernel refuse writes past it (EFBIG), like a full disk would:
// the short write must surface as an Error and roll back.
TEST(AtomicFile, ShortWriteIsAnErrorAndRollsBack) {
  TempDir dir;
  const std::string path = dir.file("big.bin");
  io::write_file_atomically(path, std::string_view("small"));
  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* previous_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limited = saved;
  limited.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  const std::string big(1 << 20, 'x');
  bool threw = false;
  std::string message;
  try {
    io::write_file_atomically(path, big);
  } catch (const Error& e) {
    threw = true;
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous_handler);
  EXPECT_TRUE(threw);
  EXPECT_NE(message.find("big.bin"), std::string::npos) << message;
  EXPECT_EQ(io::read_file(path), "small");
  expect_only(dir, {"big.bin"});
}

TEST(AtomicFile, KeepsPermissionsOfTheReplacedFile) {
  TempDir dir;
  const std::string path = dir.file("secret");
  io::write_file_atomically(path, std::string_view("v1"));
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  io::write_file_atomically(path, std::string_view("v2"));
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(io::read_file(path), "v2");
}

TEST(AtomicFile, ErrorsNameThePath) {
  TempDir dir;
  const std::string missing_dir = dir.file("no/such/dir/file.bin");
  try {
    io::write_file_atomically(missing_dir, std::string_view("x"));
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing_dir), std::string::npos) << e.what();
  }
  EXPECT_THROW(io::read_file(dir.file("absent")), Error);
  try {
    io::read_file(dir.path.string());
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("directory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(io::write_file_atomically("", std::string_view("x")), Error);
  EXPECT_FALSE(io::is_regular_file(dir.path.string()));
  EXPECT_FALSE(io::is_regular_file(dir.file("absent")));
}

TEST(AtomicFile, ReadsBinaryContentExactly) {
  TempDir dir;
  std::string bytes;
  for (int i = 0; i < 300000; ++i) bytes.push_back(static_cast<char>(i * 7 + (i >> 8)));
  bytes[5] = '\0';
  io::write_file_atomically(dir.file("bin"), bytes);
  EXPECT_EQ(io::read_file(dir.file("bin")), bytes);
}
