// Whole-file reads and crash-safe whole-file writes.
//
// A checkpoint that is half written when the process dies (or the disk fills up) must never
// replace the good checkpoint that was there before. write_file_atomically() therefore writes
// into a temporary file next to the target (same directory, so same file system), flushes it,
// fsyncs it, renames it over the target and fsyncs the directory so the rename itself is
// durable. Readers see either the complete old file or the complete new one, never a mix.
//
//   io::write_file_atomically("run/config.json", [&](std::FILE* f) {
//     io::write_bytes(f, text.data(), text.size(), "run/config.json");
//   });
//
// Every failure raises tessera::Error naming the path and the system's reason.
#pragma once

#include <cstddef>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>

namespace tessera::io {

// Writes `path` through `write`, which receives a FILE* open for binary writing on a
// temporary file "<path>.tmp.<pid>.<n>" in the same directory. On success the temporary
// replaces `path` atomically (rename) and both file and directory are fsynced. If `write`
// throws, a write or flush comes up short (ENOSPC, EFBIG, EIO, ...), fsync fails or the rename
// fails, the temporary is removed and the file previously at `path` (if any) is untouched;
// an exception thrown by `write` propagates unchanged, every other failure raises Error.
// The new file keeps the permission bits of the file it replaces (0666 & ~umask when new).
void write_file_atomically(const std::string& path, const std::function<void(std::FILE*)>& write);

// Atomically replaces `path` with exactly `contents`.
void write_file_atomically(const std::string& path, std::string_view contents);

// fwrite that raises Error (naming `what`, usually the path, and errno's reason) instead of
// returning a short count. Use it inside write_file_atomically callbacks.
void write_bytes(std::FILE* file, const void* data, size_t bytes, const std::string& what);

// The whole content of a regular file. Error when it does not exist, is not a regular file
// (a directory, for instance) or cannot be read completely.
std::string read_file(const std::string& path);

// True when `path` names an existing regular file (following symlinks).
bool is_regular_file(const std::string& path);

}  // namespace tessera::io
