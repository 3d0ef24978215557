// Crash-safe file replacement (temporary + fsync + rename + directory fsync) and whole-file
// reads, on POSIX file descriptors so every failure has an errno to report.
#include "tessera/io/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "tessera/core/error.h"

namespace tessera::io {

namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

std::string directory_of(const std::string& path) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return dir.empty() ? std::string(".") : dir;
}

// Makes the rename durable: without it a crash can lose the directory entry even though the
// file's bytes reached the disk. File systems that cannot fsync a directory say EINVAL; there
// is nothing more to do on those.
void fsync_directory(const std::string& dir, const std::string& path) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, "write_file_atomically: wrote ", path, " but cannot open its directory ", dir,
                " to fsync it: ", errno_text(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TESSERA_CHECK(rc == 0 || err == EINVAL || err == ENOTSUP, "write_file_atomically: wrote ", path,
                " but fsync of directory ", dir, " failed: ", errno_text(err));
}

// Owns the temporary until it has been renamed: the destructor closes and removes it, so
// every early exit (exception from the callback included) cleans up.
class TemporaryFile {
 public:
  explicit TemporaryFile(const std::string& target) : target_(target) {
    static std::atomic<uint64_t> counter{0};
    // pid keeps processes apart, the counter keeps threads of one process apart.
    path_ = target + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    TESSERA_CHECK(fd >= 0, "write_file_atomically: cannot create temporary file ", path_, " for ", target, ": ",
                  errno_text(errno));
    struct stat st {};
    if (::stat(target.c_str(), &st) == 0 && S_ISREG(st.st_mode)) (void)::fchmod(fd, st.st_mode & 07777);
    file_ = ::fdopen(fd, "wb");
    if (!file_) {
      const int err = errno;
      ::close(fd);
      ::unlink(path_.c_str());
      TESSERA_FAIL("write_file_atomically: cannot open a stream on ", path_, ": ", errno_text(err));
    }
  }
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  ~TemporaryFile() {
    if (file_) std::fclose(file_);
    if (!committed_) ::unlink(path_.c_str());
  }

  std::FILE* stream() const { return file_; }

  // Flush, fsync, close, rename over the target.
  void commit() {
    TESSERA_CHECK(!std::ferror(file_), "write_file_atomically: writing ", target_,
                  " failed (stream error on the temporary file); the previous file is untouched");
    TESSERA_CHECK(std::fflush(file_) == 0, "write_file_atomically: flushing ", target_, " failed: ", errno_text(errno),
                  "; the previous file is untouched");
    TESSERA_CHECK(::fsync(::fileno(file_)) == 0, "write_file_atomically: fsync of ", target_,
                  " failed: ", errno_text(errno), "; the previous file is untouched");
    std::FILE* f = file_;
    file_ = nullptr;
    TESSERA_CHECK(std::fclose(f) == 0, "write_file_atomically: closing ", target_, " failed: ", errno_text(errno),
                  "; the previous file is untouched");
    TESSERA_CHECK(::rename(path_.c_str(), target_.c_str()) == 0, "write_file_atomically: cannot rename ", path_,
                  " to ", target_, ": ", errno_text(errno), "; the previous file is untouched");
    committed_ = true;
  }

 private:
  std::string target_;
  std::string path_;
  std::FILE* file_ = nullptr;
  bool committed_ = false;
};

}  // namespace

void write_file_atomically(const std::string& path, const std::function<void(std::FILE*)>& write) {
  TESSERA_CHECK(!path.empty(), "write_file_atomically: empty path");
  TESSERA_CHECK(write != nullptr, "write_file_atomically: no writer function for ", path);
  {
    TemporaryFile tmp(path);
    write(tmp.stream());
    tmp.commit();
  }
  fsync_directory(directory_of(path), path);
}

void write_file_atomically(const std::string& path, std::string_view contents) {
  write_file_atomically(path, [&](std::FILE* f) { write_bytes(f, contents.data(), contents.size(), path); });
}

void write_bytes(std::FILE* file, const void* data, size_t bytes, const std::string& what) {
  TESSERA_CHECK(file != nullptr, "write_bytes: null FILE* while writing ", what);
  if (bytes == 0) return;
  errno = 0;
  const size_t written = std::fwrite(data, 1, bytes, file);
  if (written != bytes) {
    const int err = errno;
    TESSERA_FAIL("writing ", what, ": wrote only ", written, " of ", bytes, " bytes: ",
                 err ? errno_text(err) : std::string("stream error"));
  }
}

std::string read_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, "read_file: cannot open ", path, ": ", errno_text(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    const bool is_dir = S_ISDIR(st.st_mode);
    ::close(fd);
    TESSERA_FAIL("read_file: ", path, " is not a regular file",
                 is_dir ? std::string(" (it is a directory)") : ": " + errno_text(err));
  }
  std::string out;
  out.resize(static_cast<size_t>(st.st_size));
  size_t have = 0;
  // The size is a hint: a file that grows or shrinks while being read is read to its end.
  for (;;) {
    if (have == out.size()) out.resize(out.size() + 65536);
    const ssize_t n = ::read(fd, out.data() + have, out.size() - have);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      TESSERA_FAIL("read_file: reading ", path, " failed after ", have, " bytes: ", errno_text(err));
    }
    if (n == 0) break;
    have += static_cast<size_t>(n);
  }
  ::close(fd);
  out.resize(have);
  return out;
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace tessera::io
