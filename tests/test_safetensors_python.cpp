// Interop with the reference implementation: files tessera writes are read by the Python
// `safetensors` package (which validates strictly: no gaps, full coverage), and files it
// writes are read by tessera, compared byte for byte. Skips when python3, safetensors or
// numpy is missing (pip install safetensors numpy).
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "io_testing.h"
#include "tessera/io/atomic_file.h"
#include "tessera/io/safetensors.h"

using namespace tessera;
using namespace tessera::testing;

using StringMap = std::map<std::string, std::string>;

namespace {

// describe FILE OUT: what the reference reader sees in FILE (raw bytes of every tensor,
//   numpy's view of the dtypes numpy has, metadata).
// write DIR OUT: writes DIR/numpy.safetensors (numpy dtypes, via safetensors.numpy) and
//   DIR/raw.safetensors (BF16 and FP8, via the low-level serializer) and the expected bytes.
const char* kScript = R"PY(
import json, sys
import numpy as np
import safetensors
from safetensors import safe_open, deserialize
from safetensors.numpy import save_file

NUMPY_CODES = {"F64", "F32", "F16", "I64", "I32", "U8"}

def describe(path):
    with open(path, "rb") as f:
        raw = f.read()
    out = {"tensors": {}, "numpy": {}}
    for name, t in deserialize(raw):
        out["tensors"][name] = {"dtype": t["dtype"], "shape": list(t["shape"]), "hex": bytes(t["data"]).hex()}
    with safe_open(path, framework="numpy") as f:
        out["metadata"] = f.metadata() or {}
        for name in f.keys():
            if out["tensors"][name]["dtype"] in NUMPY_CODES:
                a = f.get_tensor(name)  # 0-d stays 0-d (np.ascontiguousarray would make it 1-d)
                out["numpy"][name] = {"shape": list(a.shape), "hex": a.tobytes(order="C").hex()}
    return out

def write(directory):
    arrays = {
        "f64": np.arange(6, dtype=np.float64).reshape(2, 3) * 0.25 - 1,
        "f32_scalar": np.array(3.5, dtype=np.float32),
        "f16_empty": np.zeros((0, 4), dtype=np.float16),
        "f16": np.array([1.0, -0.5, 65504.0, 6e-8], dtype=np.float16),
        "i64": np.array([-5, 2**40, 7], dtype=np.int64),
        "i32": np.arange(-3, 9, dtype=np.int32).reshape(3, 4),
        "u8": np.arange(250, 256).astype(np.uint8),
    }
    metadata = {"format": "pt", "source": "numpy"}
    save_file(arrays, directory + "/numpy.safetensors", metadata=metadata)
    expected = {"numpy.safetensors": {"metadata": metadata, "tensors": {}},
                "raw.safetensors": {"metadata": {"format": "raw"}, "tensors": {}}}
    codes = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "uint8": "U8"}
    for name, a in arrays.items():
        expected["numpy.safetensors"]["tensors"][name] = {
            "dtype": codes[a.dtype.name], "shape": list(a.shape), "hex": a.astype(a.dtype.newbyteorder("<")).tobytes().hex()}
    raw = {
        "bf16": ("BF16", [2, 2], bytes([0x80, 0x3F, 0x00, 0xC0, 0xC0, 0x7F, 0x01, 0x00])),
        "e4m3": ("F8_E4M3", [5], bytes([0x00, 0x38, 0x7E, 0xFE, 0x01])),
        "e5m2": ("F8_E5M2", [3], bytes([0x3C, 0x7B, 0xFC])),
        "e8m0": ("F8_E8M0", [1, 4], bytes([0x7F, 0x80, 0x00, 0xFE])),
    }
    torch_names = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}
    keep = []
    if hasattr(safetensors, "TensorSpec"):
        specs = {}
        for name, (code, shape, data) in raw.items():
            buf = np.frombuffer(data, dtype=np.uint8).copy()
            keep.append(buf)
            specs[name] = safetensors.TensorSpec(dtype=torch_names[code], shape=shape,
                                                 data_ptr=buf.ctypes.data, data_len=buf.nbytes)
    else:
        specs = {name: {"dtype": code, "shape": shape, "data": data} for name, (code, shape, data) in raw.items()}
    safetensors.serialize_file(specs, directory + "/raw.safetensors", metadata={"format": "raw"})
    for name, (code, shape, data) in raw.items():
        expected["raw.safetensors"]["tensors"][name] = {"dtype": code, "shape": shape, "hex": data.hex()}
    return expected

mode, target, out = sys.argv[1:4]
result = describe(target) if mode == "describe" else write(target)
with open(out, "w") as f:
    json.dump(result, f)
)PY";

bool python_has_safetensors() {
  return std::system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") == 0;
}

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (unsigned char c : bytes) {
    s.push_back(digits[c >> 4]);
    s.push_back(digits[c & 15]);
  }
  return s;
}

nlohmann::json run_script(const TempDir& dir, const std::string& mode, const std::string& target) {
  const std::string script = dir.file("interop.py");
  const std::string out = dir.file(mode + ".json");
  io::write_file_atomically(script, std::string_view(kScript));
  const std::string command = "python3 '" + script + "' " + mode + " '" + target + "' '" + out + "' 2>'" +
                              dir.file("stderr.txt") + "'";
  const int rc = std::system(command.c_str());
  if (rc != 0) {
    ADD_FAILURE() << "python failed (" << rc << "): " << io::read_file(dir.file("stderr.txt"));
    return nullptr;
  }
  return nlohmann::json::parse(io::read_file(out));
}

}  // namespace

TEST(SafetensorsPython, PythonReadsWhatTesseraWrites) {
  if (!python_has_safetensors()) GTEST_SKIP() << "python3 with the safetensors and numpy packages is not installed";
  TempDir dir;
  io::NamedTensors tensors;
  int seed = 0;
  for (DType d : kAllDTypes) {
    const std::string code = io::safetensors_dtype_code(d);
    tensors.emplace_back(code + ".matrix", pattern_tensor({3, 5}, d, ++seed));
    tensors.emplace_back(code + ".scalar", pattern_tensor({}, d, ++seed));
    tensors.emplace_back(code + ".empty", pattern_tensor({0, 4}, d, ++seed));
  }
  const Tensor base = pattern_tensor({4, 6}, DType::F32, 99);
  tensors.emplace_back("transposed", base.transpose(0, 1));
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "h\xC3\xA9llo \xE2\x9C\x93"}};
  const std::string path = dir.file("tessera.safetensors");
  io::save_safetensors(path, tensors, metadata);

  const nlohmann::json seen = run_script(dir, "describe", path);
  ASSERT_FALSE(seen.is_null());
  EXPECT_EQ(seen["metadata"].get<StringMap>(), metadata);
  ASSERT_EQ(seen["tensors"].size(), tensors.size());
  size_t numpy_count = 0;
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(seen["tensors"].contains(name)) << name;
    const nlohmann::json& entry = seen["tensors"][name];
    EXPECT_EQ(entry["dtype"], io::safetensors_dtype_code(t.dtype())) << name;
    EXPECT_EQ(entry["shape"].get<Shape>(), t.shape()) << name;
    EXPECT_EQ(entry["hex"], to_hex(bytes_of(t))) << name;
    if (seen["numpy"].contains(name)) {
      ++numpy_count;
      EXPECT_EQ(seen["numpy"][name]["shape"].get<Shape>(), t.shape()) << name;
      EXPECT_EQ(seen["numpy"][name]["hex"], to_hex(bytes_of(t))) << name;
    }
  }
  EXPECT_EQ(numpy_count, 6u * 3u + 1u);  // F64 F32 F16 I64 I32 U8, and the transposed F32
}

TEST(SafetensorsPython, TesseraReadsWhatPythonWrites) {
  if (!python_has_safetensors()) GTEST_SKIP() << "python3 with the safetensors and numpy packages is not installed";
  TempDir dir;
  const nlohmann::json expected = run_script(dir, "write", dir.path.string());
  ASSERT_FALSE(expected.is_null());
  for (const auto& [file_name, want] : expected.items()) {
    io::SafetensorsFile file(dir.file(file_name));
    EXPECT_EQ(file.metadata(), want["metadata"].get<StringMap>()) << file_name;
    EXPECT_EQ(file.size(), want["tensors"].size()) << file_name;
    for (const auto& [name, tensor] : want["tensors"].items()) {
      const Tensor t = file.get(name);
      EXPECT_EQ(io::safetensors_dtype_code(t.dtype()), tensor["dtype"].get<std::string>()) << name;
      EXPECT_EQ(t.shape(), tensor["shape"].get<Shape>()) << name;
      EXPECT_EQ(to_hex(bytes_of(t)), tensor["hex"].get<std::string>()) << name;
    }
  }
  // Spot-check values, not just bytes.
  io::SafetensorsFile numpy_file(dir.file("numpy.safetensors"));
  EXPECT_EQ(numpy_file.get("f64").to_doubles(), (std::vector<double>{-1, -0.75, -0.5, -0.25, 0, 0.25}));
  EXPECT_EQ(numpy_file.get("f32_scalar").to_doubles(), (std::vector<double>{3.5}));
  EXPECT_EQ(numpy_file.get("i64").to_ints(), (std::vector<int64_t>{-5, int64_t{1} << 40, 7}));
  io::SafetensorsFile raw_file(dir.file("raw.safetensors"));
  EXPECT_EQ(raw_file.get("bf16").to_doubles()[0], 1.0);
  EXPECT_EQ(raw_file.get("bf16").to_doubles()[1], -2.0);
  EXPECT_EQ(raw_file.get("e4m3").to_doubles()[1], 1.0);   // 0x38
  EXPECT_EQ(raw_file.get("e5m2").to_doubles()[0], 1.0);   // 0x3C
  EXPECT_EQ(raw_file.get("e8m0").to_doubles()[0], 1.0);   // 0x7F = 2^0
}
