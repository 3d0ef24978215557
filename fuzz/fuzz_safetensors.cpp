// libFuzzer target: the safetensors reader. A file that opens must be fully readable: every
// tensor's bytes lie inside the file and get() copies them without error (except dtypes
// tessera has no type for, which raise Error).
#include <cstdint>

#include "fuzz_util.h"
#include "tessera/core/error.h"
#include "tessera/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = fuzz_util::scratch_path("input.safetensors");
  fuzz_util::write(path, data, size);
  try {
    const tessera::io::SafetensorsFile file(path);
    for (const tessera::io::TensorInfo& info : file.infos()) {
      if (info.data_end > file.data_bytes() || info.data_begin > info.data_end) __builtin_trap();
      if (!info.dtype) continue;
      if (info.nbytes() > (64u << 20)) continue;  // keep each run cheap
      const tessera::Tensor t = file.get(info.name);
      if (t.shape() != info.shape) __builtin_trap();
    }
  } catch (const tessera::Error&) {
  }
  return 0;
}
