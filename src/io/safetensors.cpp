// Reading and writing single safetensors files.
//
// Reading: the file is mmapped read-only and its header is validated completely at open
// (lengths, JSON structure, dtypes, shapes, offsets, sizes, overlaps), so later reads can
// trust every offset. Tensors are copied out of the mapping into owned tensors: core Tensor
// storage cannot hold a reference to the mapping, and a copy keeps lifetimes trivially safe.
// Writing streams the header and then each tensor (packed on the CPU one at a time) through
// write_file_atomically(). The format is little-endian; big-endian hosts swap bytes.
#include "tessera/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "tessera/io/atomic_file.h"

namespace tessera::io {

namespace {

using ordered_json = nlohmann::ordered_json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the limit of the Hugging Face reader

struct DTypeCode {
  const char* code;
  int bits;
  std::optional<DType> dtype;
};

// Every dtype the format defines (safetensors 0.6+), with tessera's type where there is one.
const DTypeCode kCodes[] = {
    {"F64", 64, DType::F64},   {"F32", 32, DType::F32},         {"F16", 16, DType::F16},
    {"BF16", 16, DType::BF16}, {"F8_E4M3", 8, DType::E4M3},     {"F8_E5M2", 8, DType::E5M2},
    {"F8_E8M0", 8, DType::E8M0}, {"I64", 64, DType::I64},       {"I32", 32, DType::I32},
    {"U8", 8, DType::U8},      {"BOOL", 8, std::nullopt},       {"I8", 8, std::nullopt},
    {"I16", 16, std::nullopt}, {"U16", 16, std::nullopt},       {"U32", 32, std::nullopt},
    {"U64", 64, std::nullopt}, {"F8_E4M3FNUZ", 8, std::nullopt}, {"F8_E5M2FNUZ", 8, std::nullopt},
    {"F4", 4, std::nullopt},   {"F6_E2M3", 6, std::nullopt},    {"F6_E3M2", 6, std::nullopt},
    {"C64", 64, std::nullopt},
};

const DTypeCode* find_code(const std::string& code) {
  for (const DTypeCode& c : kCodes) {
    if (code == c.code) return &c;
  }
  return nullptr;
}

std::string known_codes() {
  std::string s;
  for (const DTypeCode& c : kCodes) s += (s.empty() ? "" : ", ") + std::string(c.code);
  return s;
}

// The format stores little-endian; on a big-endian host every element is reversed in place.
void swap_to_or_from_little_endian(void* data, size_t count, size_t element_size) {
  if constexpr (std::endian::native == std::endian::little) {
    (void)data, (void)count, (void)element_size;
  } else {
    auto* p = static_cast<uint8_t*>(data);
    if (element_size > 1) {
      for (size_t i = 0; i < count; ++i) std::reverse(p + i * element_size, p + (i + 1) * element_size);
    }
  }
}

// Parses the JSON header, rejecting repeated keys in any object (nlohmann keeps the last).
ordered_json parse_header_json(const char* text, size_t length, const std::string& where) {
  std::vector<std::set<std::string>> keys_per_object;
  std::string duplicate;
  auto callback = [&](int, ordered_json::parse_event_t event, ordered_json& parsed) {
    using E = ordered_json::parse_event_t;
    if (event == E::object_start) {
      keys_per_object.emplace_back();
    } else if (event == E::object_end) {
      if (!keys_per_object.empty()) keys_per_object.pop_back();
    } else if (event == E::key && !keys_per_object.empty()) {
      const std::string key = parsed.get<std::string>();
      if (!keys_per_object.back().insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  ordered_json header;
  try {
    header = ordered_json::parse(text, text + length, callback);
  } catch (const ordered_json::exception& e) {
    TESSERA_FAIL("safetensors: ", where, ": the header is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(duplicate.empty(), "safetensors: ", where, ": the header repeats the key '", duplicate, "'");
  TESSERA_CHECK(header.is_object(), "safetensors: ", where, ": the header must be a JSON object, got a ",
                header.type_name());
  return header;
}

// A JSON integer that must be >= 0 and fit in int64.
bool non_negative_integer(const ordered_json& v, uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<uint64_t>();
    return out <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  }
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    out = static_cast<uint64_t>(x);
    return x >= 0;
  }
  return false;
}

TensorInfo parse_entry(const std::string& name, const ordered_json& entry, uint64_t data_size,
                       const std::string& where) {
  const std::string at = "safetensors: " + where + ": tensor '" + name + "'";
  TESSERA_CHECK(entry.is_object(), at, ": entry must be a JSON object, got ", entry.dump());
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    TESSERA_CHECK(entry.contains(field), at, ": entry has no \"", field, "\": ", entry.dump());
  }
  const ordered_json& dtype = entry["dtype"];
  const ordered_json& shape = entry["shape"];
  const ordered_json& offsets = entry["data_offsets"];
  TESSERA_CHECK(dtype.is_string(), at, ": \"dtype\" must be a string, got ", dtype.dump());
  TESSERA_CHECK(shape.is_array(), at, ": \"shape\" must be an array of integers, got ", shape.dump());
  TESSERA_CHECK(offsets.is_array() && offsets.size() == 2, at,
                ": \"data_offsets\" must be an array [begin, end], got ", offsets.dump());

  TensorInfo info;
  info.name = name;
  info.dtype_code = dtype.get<std::string>();
  const DTypeCode* code = find_code(info.dtype_code);
  TESSERA_CHECK(code != nullptr, at, ": unknown dtype \"", info.dtype_code, "\" (the format defines ", known_codes(),
                ")");
  info.dtype = code->dtype;

  int64_t numel = 1;
  for (const ordered_json& d : shape) {
    uint64_t size = 0;
    TESSERA_CHECK(d.is_number_integer(), at, ": \"shape\" must hold integers, got ", shape.dump());
    TESSERA_CHECK(non_negative_integer(d, size), at, ": \"shape\" ", shape.dump(),
                  " has a negative or too large dimension");
    info.shape.push_back(static_cast<int64_t>(size));
    TESSERA_CHECK(!__builtin_mul_overflow(numel, static_cast<int64_t>(size), &numel), at, ": shape ", shape.dump(),
                  " has too many elements");
  }

  TESSERA_CHECK(non_negative_integer(offsets[0], info.data_begin) && non_negative_integer(offsets[1], info.data_end),
                at, ": \"data_offsets\" must be two non-negative integers, got ", offsets.dump());
  TESSERA_CHECK(info.data_begin <= info.data_end, at, ": data_offsets ", offsets.dump(), " end before they begin");
  TESSERA_CHECK(info.data_end <= data_size, at, ": data_offsets ", offsets.dump(),
                " reach beyond the data buffer of ", data_size, " bytes (file truncated?)");
  uint64_t bits = 0;
  TESSERA_CHECK(!__builtin_mul_overflow(static_cast<uint64_t>(numel), static_cast<uint64_t>(code->bits), &bits), at,
                ": shape ", shape.dump(), " is too large");
  TESSERA_CHECK(bits % 8 == 0, at, ": ", numel, " elements of ", info.dtype_code, " do not fill whole bytes");
  TESSERA_CHECK(info.data_end - info.data_begin == bits / 8, at, ": ", info.dtype_code, shape.dump(), " needs ",
                bits / 8, " bytes but data_offsets ", offsets.dump(), " hold ", info.data_end - info.data_begin);
  return info;
}

std::map<std::string, std::string> parse_metadata(const ordered_json& m, const std::string& where) {
  TESSERA_CHECK(m.is_object(), "safetensors: ", where, ": \"__metadata__\" must be an object of strings, got ",
                m.dump());
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : m.items()) {
    TESSERA_CHECK(value.is_string(), "safetensors: ", where, ": metadata value of '", key,
                  "' must be a string, got ", value.dump());
    out[key] = value.get<std::string>();
  }
  return out;
}

class Mapping {
 public:
  explicit Mapping(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TESSERA_CHECK(fd >= 0, "safetensors: cannot open ", path, ": ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      TESSERA_FAIL("safetensors: ", path, " is not a regular file");
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ < 8) {
      ::close(fd);
      TESSERA_FAIL("safetensors: ", path, ": file is ", size_, " bytes, shorter than the 8-byte header length");
    }
    void* addr = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);  // the mapping keeps the file alive
    TESSERA_CHECK(addr != MAP_FAILED, "safetensors: cannot map ", path, " (", size_, " bytes): ", std::strerror(err));
    data_ = static_cast<const uint8_t*>(addr);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { ::munmap(const_cast<uint8_t*>(data_), size_); }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace

const char* safetensors_dtype_code(DType dtype) {
  for (const DTypeCode& c : kCodes) {
    if (c.dtype == dtype) return c.code;
  }
  TESSERA_FAIL("safetensors: dtype ", dtype_name(dtype), " has no safetensors code");
}

std::optional<DType> dtype_from_safetensors_code(const std::string& code) {
  const DTypeCode* c = find_code(code);
  TESSERA_CHECK(c != nullptr, "safetensors: unknown dtype \"", code, "\" (the format defines ", known_codes(), ")");
  return c->dtype;
}

// ---- SafetensorsFile ----------------------------------------------------------------------

struct SafetensorsFile::Impl {
  std::string path;
  std::unique_ptr<Mapping> mapping;
  uint64_t header_bytes = 0;
  const uint8_t* data = nullptr;  // start of the data buffer
  uint64_t data_bytes = 0;
  std::vector<TensorInfo> infos;  // data-buffer order
  std::unordered_map<std::string, size_t> by_name;
  std::map<std::string, std::string> metadata;

  const TensorInfo& find(const std::string& name) const {
    auto it = by_name.find(name);
    TESSERA_CHECK(it != by_name.end(), "safetensors: ", path, " has no tensor '", name, "' (it holds ", infos.size(),
                  " tensors)");
    return infos[it->second];
  }
};

SafetensorsFile::SafetensorsFile(const std::string& path) {
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  impl->mapping = std::make_unique<Mapping>(path);
  const uint8_t* bytes = impl->mapping->data();
  const uint64_t file_size = impl->mapping->size();

  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  TESSERA_CHECK(n <= kMaxHeaderBytes, "safetensors: ", path, ": header length ", n,
                " is absurd (limit 100000000 bytes); not a safetensors file?");
  TESSERA_CHECK(n <= file_size - 8, "safetensors: ", path, ": header length ", n, " exceeds the ", file_size - 8,
                " bytes after the length field (file truncated?)");
  TESSERA_CHECK(n >= 2, "safetensors: ", path, ": header length ", n, " is too short for a JSON object");
  impl->header_bytes = n;
  impl->data = bytes + 8 + n;
  impl->data_bytes = file_size - 8 - n;

  const ordered_json header = parse_header_json(reinterpret_cast<const char*>(bytes + 8), n, path);
  std::vector<TensorInfo> infos;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      impl->metadata = parse_metadata(value, path);
    } else {
      infos.push_back(parse_entry(key, value, impl->data_bytes, path));
    }
  }
  // File order is data-buffer order; zero-byte tensors sort before a tensor at the same offset.
  std::stable_sort(infos.begin(), infos.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.data_begin != b.data_begin ? a.data_begin < b.data_begin : a.data_end < b.data_end;
  });
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& info : infos) {
    if (info.nbytes() == 0) continue;
    TESSERA_CHECK(previous == nullptr || info.data_begin >= previous->data_end, "safetensors: ", path,
                  ": tensors '", previous ? previous->name : "", "' [", previous ? previous->data_begin : 0, ", ",
                  previous ? previous->data_end : 0, ") and '", info.name, "' [", info.data_begin, ", ",
                  info.data_end, ") overlap in the data buffer");
    previous = &info;
  }
  for (size_t i = 0; i < infos.size(); ++i) impl->by_name.emplace(infos[i].name, i);
  impl->infos = std::move(infos);
  impl_ = std::move(impl);
}

const std::string& SafetensorsFile::path() const { return impl_->path; }
size_t SafetensorsFile::size() const { return impl_->infos.size(); }
const std::vector<TensorInfo>& SafetensorsFile::infos() const { return impl_->infos; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return impl_->metadata; }
uint64_t SafetensorsFile::header_bytes() const { return impl_->header_bytes; }
uint64_t SafetensorsFile::data_bytes() const { return impl_->data_bytes; }
bool SafetensorsFile::contains(const std::string& name) const { return impl_->by_name.count(name) != 0; }
const TensorInfo& SafetensorsFile::info(const std::string& name) const { return impl_->find(name); }

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const TensorInfo& info : impl_->infos) out.push_back(info.name);
  return out;
}

std::vector<std::string> SafetensorsFile::sorted_names() const {
  std::vector<std::string> out = names();
  std::sort(out.begin(), out.end());
  return out;
}

const uint8_t* SafetensorsFile::raw_bytes(const std::string& name) const {
  return impl_->data + impl_->find(name).data_begin;
}

Tensor SafetensorsFile::get(const std::string& name, Device device) const {
  const TensorInfo& info = impl_->find(name);
  TESSERA_CHECK(info.dtype.has_value(), "safetensors: ", impl_->path, ": tensor '", name, "' has dtype ",
                info.dtype_code, ", which tessera has no type for (supported: F64, F32, F16, BF16, F8_E4M3, ",
                "F8_E5M2, F8_E8M0, I64, I32, U8)");
  Tensor t = Tensor::empty(info.shape, *info.dtype);
  if (info.nbytes() > 0) {
    std::memcpy(t.raw_data(), impl_->data + info.data_begin, info.nbytes());
    swap_to_or_from_little_endian(t.raw_data(), static_cast<size_t>(t.numel()), dtype_size(*info.dtype));
  }
  return device.is_cpu() ? t : t.to(device);
}

void SafetensorsFile::read_into(const std::string& name, Tensor& dst) const {
  const TensorInfo& info = impl_->find(name);
  TESSERA_CHECK(dst.defined(), "safetensors: read_into '", name, "' from ", impl_->path,
                ": destination is an undefined tensor");
  TESSERA_CHECK(info.dtype.has_value() && dst.dtype() == *info.dtype && dst.shape() == info.shape,
                "safetensors: read_into '", name, "' from ", impl_->path, ": file holds ", info.dtype_code,
                shape_to_string(info.shape), " but the destination is ", dst.describe());
  if (dst.device().is_cpu() && dst.is_contiguous()) {
    if (info.nbytes() == 0) return;
    std::memcpy(dst.raw_data(), impl_->data + info.data_begin, info.nbytes());
    swap_to_or_from_little_endian(dst.raw_data(), static_cast<size_t>(dst.numel()), dtype_size(dst.dtype()));
    return;
  }
  dst.copy_from(get(name));
}

std::map<std::string, Tensor> load_safetensors(const std::string& path, Device device) {
  const SafetensorsFile file(path);
  std::map<std::string, Tensor> out;
  for (const TensorInfo& info : file.infos()) out.emplace(info.name, file.get(info.name, device));
  return out;
}

// ---- Writing --------------------------------------------------------------------------------

// Checks the inputs, lays out the data buffer and builds the padded header; then emits the
// header and each tensor's bytes through `sink`.
void write_safetensors(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata,
                       const std::string& where, const std::function<void(const void*, size_t)>& sink) {
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    TESSERA_CHECK(!name.empty(), "save_safetensors: ", where, ": a tensor has an empty name");
    TESSERA_CHECK(name != "__metadata__", "save_safetensors: ", where,
                  ": \"__metadata__\" is reserved and cannot name a tensor");
    TESSERA_CHECK(seen.insert(name).second, "save_safetensors: ", where, ": tensor name '", name,
                  "' appears twice");
    TESSERA_CHECK(t.defined(), "save_safetensors: ", where, ": tensor '", name, "' is an undefined tensor");
  }
  // Largest elements first keeps every tensor aligned to its element size within the buffer.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dtype_size(tensors[a].second.dtype()) > dtype_size(tensors[b].second.dtype());
  });

  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json m = ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    ordered_json shape = ordered_json::array();
    for (int64_t d : t.shape()) shape.push_back(d);
    header[name] = {{"dtype", safetensors_dtype_code(t.dtype())},
                    {"shape", shape},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const ordered_json::exception& e) {
    TESSERA_FAIL("save_safetensors: ", where, ": tensor names and metadata must be valid UTF-8: ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data buffer starts 8-byte aligned

  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  sink(length, 8);
  sink(text.data(), text.size());
  for (size_t i : order) {
    const Tensor& t = tensors[i].second;
    if (t.numel() == 0) continue;
    Tensor packed = t.to(Device::cpu()).contiguous();
    if constexpr (std::endian::native != std::endian::little) {
      packed = packed.clone();
      swap_to_or_from_little_endian(packed.raw_data(), static_cast<size_t>(packed.numel()), dtype_size(t.dtype()));
    }
    sink(packed.raw_data(), packed.nbytes());
  }
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  write_file_atomically(path, [&](std::FILE* f) {
    write_safetensors(tensors, metadata, path,
                      [&](const void* data, size_t bytes) { write_bytes(f, data, bytes, path); });
  });
}

std::string serialize_safetensors(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  std::string out;
  write_safetensors(tensors, metadata, "(in memory)", [&](const void* data, size_t bytes) {
    out.append(static_cast<const char*>(data), bytes);
  });
  return out;
}

}  // namespace tessera::io
