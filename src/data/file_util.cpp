// Memory mappings and atomic writes for the token files (POSIX: mmap, fsync, rename).
#include "data/file_util.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

namespace tessera::data {
namespace {

constexpr size_t kWriteBufferBytes = 1 << 20;

std::string errno_text() { return std::strerror(errno); }

}  // namespace

std::shared_ptr<const MappedFile> MappedFile::open(const std::string& path, const char* what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, what, " '", path, "': cannot open: ", errno_text());
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    const std::string reason = S_ISDIR(info.st_mode) ? "is a directory" : "is not a regular file";
    ::close(fd);
    TESSERA_FAIL(what, " '", path, "': ", reason);
  }
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->path_ = path;
  file->size_ = static_cast<size_t>(info.st_size);
  if (file->size_ > 0) {
    void* mapped = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapped == MAP_FAILED) {
      const std::string reason = errno_text();
      ::close(fd);
      TESSERA_FAIL(what, " '", path, "': cannot map ", file->size_, " bytes: ", reason);
    }
    file->data_ = static_cast<const uint8_t*>(mapped);
  }
  ::close(fd);  // the mapping keeps the file
  return file;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

std::string parent_directory(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

bool file_exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

AtomicFileWriter::AtomicFileWriter(const std::string& path) : path_(path) {
  std::string pattern = path + ".tmp.XXXXXX";
  std::vector<char> name(pattern.begin(), pattern.end());
  name.push_back('\0');
  fd_ = ::mkstemp(name.data());
  TESSERA_CHECK(fd_ >= 0, "cannot create a temporary file next to '", path, "': ", errno_text());
  temp_path_ = name.data();
  // mkstemp creates 0600; data files are meant to be shared like any other output.
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::fchmod(fd_, 0666 & ~mask);
  buffer_.reserve(kWriteBufferBytes);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_path_.empty()) ::unlink(temp_path_.c_str());
}

void AtomicFileWriter::write_all(const char* bytes, size_t count) {
  while (count > 0) {
    const ssize_t n = ::write(fd_, bytes, count);
    if (n < 0 && errno == EINTR) continue;
    TESSERA_CHECK(n > 0, "cannot write '", temp_path_, "' (for '", path_, "'): ", errno_text());
    bytes += n;
    count -= static_cast<size_t>(n);
  }
}

void AtomicFileWriter::flush_buffer() {
  write_all(buffer_.data(), buffer_.size());
  buffer_.clear();
}

void AtomicFileWriter::write(const void* bytes, size_t count) {
  TESSERA_CHECK(fd_ >= 0 && !synced_, "write to '", path_, "' after it was committed");
  bytes_written_ += static_cast<int64_t>(count);
  if (buffer_.size() + count > kWriteBufferBytes) flush_buffer();
  if (count >= kWriteBufferBytes) {
    write_all(static_cast<const char*>(bytes), count);  // large writes skip the buffer
  } else {
    buffer_.append(static_cast<const char*>(bytes), count);
  }
}

void AtomicFileWriter::sync() {
  TESSERA_CHECK(fd_ >= 0, "'", path_, "' was already committed");
  flush_buffer();
  TESSERA_CHECK(::fsync(fd_) == 0, "cannot fsync '", temp_path_, "': ", errno_text());
  const int status = ::close(fd_);
  fd_ = -1;
  TESSERA_CHECK(status == 0, "cannot close '", temp_path_, "': ", errno_text());
  synced_ = true;
}

void AtomicFileWriter::commit_rename() {
  TESSERA_CHECK(synced_ && !committed_, "commit_rename of '", path_, "' needs one sync() first");
  TESSERA_CHECK(::rename(temp_path_.c_str(), path_.c_str()) == 0, "cannot rename '", temp_path_, "' to '", path_,
                "': ", errno_text());
  committed_ = true;
  // The rename itself is durable only once the directory entry is on disk.
  const int dir = ::open(parent_directory(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

}  // namespace tessera::data
