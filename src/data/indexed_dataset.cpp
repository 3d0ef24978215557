// Megatron-LM's indexed dataset (MMIDIDX .idx + .bin): reader and writer.
//
// The layout follows megatron/core/datasets/indexed_dataset.py (_IndexWriter/_IndexReader):
// a 34-byte header, then int32 lengths, int64 byte pointers and int64 document indices,
// all little-endian and packed. The reader validates everything once at open, so reads
// afterwards only bounds-check their arguments.
#include <algorithm>
#include <limits>
#include <string>

#include "data/file_util.h"
#include "tessera/data/token_file.h"

namespace tessera::data {
namespace {

constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kIndexHeaderBytes = 9 + 8 + 1 + 8 + 8;

template <typename T>
void convert_tokens(const uint8_t* src, size_t count, int32_t* out, const std::string& path, int64_t first) {
  for (size_t i = 0; i < count; ++i) {
    out[i] = token_to_int32(load_unaligned<T>(src + i * sizeof(T)), "Megatron .bin", path,
                            first + static_cast<int64_t>(i));
  }
}

void convert_any(IndexedDType dtype, const uint8_t* src, size_t count, int32_t* out, const std::string& path,
                 int64_t first) {
  switch (dtype) {
    case IndexedDType::U8: return convert_tokens<uint8_t>(src, count, out, path, first);
    case IndexedDType::I8: return convert_tokens<int8_t>(src, count, out, path, first);
    case IndexedDType::I16: return convert_tokens<int16_t>(src, count, out, path, first);
    case IndexedDType::I32: return convert_tokens<int32_t>(src, count, out, path, first);
    case IndexedDType::I64: return convert_tokens<int64_t>(src, count, out, path, first);
    case IndexedDType::F64: return convert_tokens<double>(src, count, out, path, first);
    case IndexedDType::F32: return convert_tokens<float>(src, count, out, path, first);
    case IndexedDType::U16: return convert_tokens<uint16_t>(src, count, out, path, first);
  }
  TESSERA_FAIL("Megatron dataset: unknown dtype code ", static_cast<int>(dtype));
}

// Whether `token` is stored exactly by `dtype`.
bool fits(IndexedDType dtype, int32_t token) {
  switch (dtype) {
    case IndexedDType::U8: return token >= 0 && token <= 255;
    case IndexedDType::I8: return token >= -128 && token <= 127;
    case IndexedDType::I16: return token >= -32768 && token <= 32767;
    case IndexedDType::U16: return token >= 0 && token <= 65535;
    case IndexedDType::F32: return token >= -(1 << 24) && token <= (1 << 24);  // exact float integers
    case IndexedDType::I32:
    case IndexedDType::I64:
    case IndexedDType::F64: return true;
  }
  return false;
}

template <typename T>
void store_tokens(std::span<const int32_t> tokens, std::string& bytes) {
  const size_t start = bytes.size();
  bytes.resize(start + tokens.size() * sizeof(T));
  for (size_t i = 0; i < tokens.size(); ++i) {
    const T value = static_cast<T>(tokens[i]);
    std::memcpy(bytes.data() + start + i * sizeof(T), &value, sizeof(T));
  }
}

// 34 + 12 S + 8 D in decimal; S and D come from a possibly corrupt header, so 128-bit.
std::string index_bytes_needed(uint64_t num_sequences, uint64_t num_doc_indices) {
  unsigned __int128 n = kIndexHeaderBytes;
  n += static_cast<unsigned __int128>(num_sequences) * 12 + static_cast<unsigned __int128>(num_doc_indices) * 8;
  std::string digits;
  do {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(n % 10)));
    n /= 10;
  } while (n > 0);
  return digits;
}

}  // namespace

size_t indexed_dtype_size(IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::U8:
    case IndexedDType::I8: return 1;
    case IndexedDType::I16:
    case IndexedDType::U16: return 2;
    case IndexedDType::I32:
    case IndexedDType::F32: return 4;
    case IndexedDType::I64:
    case IndexedDType::F64: return 8;
  }
  TESSERA_FAIL("Megatron dataset: unknown dtype code ", static_cast<int>(dtype));
}

const char* indexed_dtype_name(IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::U8: return "uint8";
    case IndexedDType::I8: return "int8";
    case IndexedDType::I16: return "int16";
    case IndexedDType::I32: return "int32";
    case IndexedDType::I64: return "int64";
    case IndexedDType::F64: return "float64";
    case IndexedDType::F32: return "float32";
    case IndexedDType::U16: return "uint16";
  }
  return "unknown";
}

// ---- Reader ----------------------------------------------------------------------------

IndexedDataset IndexedDataset::open(const std::string& prefix) {
  IndexedDataset ds;
  ds.prefix_ = prefix;
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  ds.index_ = MappedFile::open(idx_path, "Megatron .idx");
  ds.data_ = MappedFile::open(bin_path, "Megatron .bin");
  const uint8_t* idx = ds.index_->data();
  const size_t idx_size = ds.index_->size(), bin_size = ds.data_->size();

  TESSERA_CHECK(idx_size >= kIndexHeaderBytes, "Megatron .idx '", idx_path, "': truncated: ", idx_size,
                " bytes, the header alone has ", kIndexHeaderBytes);
  TESSERA_CHECK(std::memcmp(idx, kIndexMagic, sizeof(kIndexMagic)) == 0, "Megatron .idx '", idx_path,
                "': bad magic: expected \"MMIDIDX\\0\\0\"; not a Megatron indexed dataset index");
  const uint64_t version = load_unaligned<uint64_t>(idx + 9);
  TESSERA_CHECK(version == 1, "Megatron .idx '", idx_path, "': version ", version, ", only version 1 is known");
  const uint8_t code = idx[17];
  TESSERA_CHECK(code >= 1 && code <= 8, "Megatron .idx '", idx_path, "': unknown dtype code ", int(code),
                " (known: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)");
  ds.dtype_ = static_cast<IndexedDType>(code);
  const size_t item = indexed_dtype_size(ds.dtype_);
  const uint64_t num_sequences = load_unaligned<uint64_t>(idx + 18);
  const uint64_t num_doc_indices = load_unaligned<uint64_t>(idx + 26);

  // Compare counts against the file size before multiplying, so absurd counts cannot overflow.
  const uint64_t body = idx_size - kIndexHeaderBytes;
  const bool fits_in_file = num_sequences <= body / 12 && num_doc_indices <= (body - num_sequences * 12) / 8;
  TESSERA_CHECK(fits_in_file, "Megatron .idx '", idx_path, "': truncated: ", idx_size, " bytes, but its header lists ",
                num_sequences, " sequences and ", num_doc_indices, " document indices, which need ",
                index_bytes_needed(num_sequences, num_doc_indices), " bytes");
  ds.num_sequences_ = static_cast<int64_t>(num_sequences);
  ds.lengths_offset_ = kIndexHeaderBytes;
  ds.pointers_offset_ = kIndexHeaderBytes + 4 * num_sequences;
  const size_t docs_offset = ds.pointers_offset_ + 8 * num_sequences;

  int64_t total = 0;
  for (int64_t i = 0; i < ds.num_sequences_; ++i) {
    const int64_t length = ds.sequence_length(i), pointer = ds.sequence_pointer(i);
    TESSERA_CHECK(length >= 0 && pointer >= 0, "Megatron .idx '", idx_path, "': sequence ", i, " has length ", length,
                  " and byte offset ", pointer, "; both must be >= 0");
    TESSERA_CHECK(static_cast<uint64_t>(pointer) <= bin_size &&
                      static_cast<uint64_t>(length) <= (bin_size - static_cast<uint64_t>(pointer)) / item,
                  "Megatron dataset '", prefix, "': sequence ", i, " (", length, " ", indexed_dtype_name(ds.dtype_),
                  " tokens at byte ", pointer, ") extends past the end of the .bin (", bin_size,
                  " bytes): the .bin is truncated or does not belong to this .idx");
    if (i > 0) {
      const int64_t previous_end = ds.sequence_pointer(i - 1) + ds.sequence_length(i - 1) * static_cast<int64_t>(item);
      if (pointer != previous_end) ds.packed_ = false;
    }
    total += length;
  }
  ds.num_tokens_ = total;
  if (!ds.packed_) {
    ds.sequence_starts_.resize(num_sequences + 1);
    ds.sequence_starts_[0] = 0;
    for (int64_t i = 0; i < ds.num_sequences_; ++i) {
      ds.sequence_starts_[i + 1] = ds.sequence_starts_[i] + ds.sequence_length(i);
    }
  }

  ds.document_indices_.resize(num_doc_indices);
  for (uint64_t k = 0; k < num_doc_indices; ++k) {
    ds.document_indices_[k] = load_unaligned<int64_t>(idx + docs_offset + 8 * k);
  }
  TESSERA_CHECK(!ds.document_indices_.empty() && ds.document_indices_[0] == 0, "Megatron .idx '", idx_path,
                "': the document indices must start with 0");
  for (uint64_t k = 1; k < num_doc_indices; ++k) {
    const int64_t previous = ds.document_indices_[k - 1], current = ds.document_indices_[k];
    TESSERA_CHECK(current >= previous && current <= ds.num_sequences_, "Megatron .idx '", idx_path,
                  "': document index ", k, " is ", current, " after ", previous, "; they must be non-decreasing and <= ",
                  ds.num_sequences_, " (the sequence count)");
  }
  return ds;
}

int64_t IndexedDataset::sequence_length(int64_t i) const {
  TESSERA_CHECK(i >= 0 && i < num_sequences_, "Megatron dataset '", prefix_, "': sequence ", i,
                " out of range [0, ", num_sequences_, ")");
  return load_unaligned<int32_t>(index_->data() + lengths_offset_ + 4 * static_cast<size_t>(i));
}

int64_t IndexedDataset::sequence_pointer(int64_t i) const {
  TESSERA_CHECK(i >= 0 && i < num_sequences_, "Megatron dataset '", prefix_, "': sequence ", i,
                " out of range [0, ", num_sequences_, ")");
  return load_unaligned<int64_t>(index_->data() + pointers_offset_ + 8 * static_cast<size_t>(i));
}

void IndexedDataset::read_sequence(int64_t i, int64_t offset, std::span<int32_t> out) const {
  const int64_t length = sequence_length(i);
  const int64_t count = static_cast<int64_t>(out.size());
  TESSERA_CHECK(offset >= 0 && offset <= length && count <= length - offset, "Megatron dataset '", prefix_,
                "': tokens [", offset, ", ", offset + count, ") of sequence ", i, " are outside its ", length,
                " tokens");
  const size_t item = indexed_dtype_size(dtype_);
  const uint8_t* src = data_->data() + sequence_pointer(i) + static_cast<size_t>(offset) * item;
  convert_any(dtype_, src, out.size(), out.data(), data_->path(), offset);
}

std::vector<int32_t> IndexedDataset::sequence(int64_t i) const {
  std::vector<int32_t> tokens(static_cast<size_t>(sequence_length(i)));
  read_sequence(i, 0, tokens);
  return tokens;
}

void IndexedDataset::read_tokens(int64_t start, std::span<int32_t> out) const {
  const int64_t count = static_cast<int64_t>(out.size());
  TESSERA_CHECK(start >= 0 && start <= num_tokens_ && count <= num_tokens_ - start, "Megatron dataset '", prefix_,
                "': tokens [", start, ", ", start + count, ") are outside its ", num_tokens_, " tokens");
  if (count == 0) return;
  if (packed_) {
    const size_t item = indexed_dtype_size(dtype_);
    const uint8_t* src = data_->data() + sequence_pointer(0) + static_cast<size_t>(start) * item;
    convert_any(dtype_, src, out.size(), out.data(), data_->path(), start);
    return;
  }
  // The sequence holding `start`: the last one whose first token is <= start.
  int64_t seq = std::upper_bound(sequence_starts_.begin(), sequence_starts_.end(), start) - sequence_starts_.begin() - 1;
  int64_t done = 0;
  while (done < count) {
    const int64_t offset = start + done - sequence_starts_[seq];
    const int64_t take = std::min(sequence_length(seq) - offset, count - done);
    read_sequence(seq, offset, out.subspan(static_cast<size_t>(done), static_cast<size_t>(take)));
    done += take;
    ++seq;
  }
}

// ---- Writer ----------------------------------------------------------------------------

struct IndexedDatasetWriter::Impl {
  std::string prefix;
  IndexedDType dtype;
  AtomicFileWriter bin;
  std::vector<int32_t> lengths;
  std::vector<int64_t> document_indices{0};
  std::string scratch;
  bool finalized = false;

  Impl(const std::string& p, IndexedDType d) : prefix(p), dtype(d), bin(p + ".bin") {}
};

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, IndexedDType dtype) {
  const int code = static_cast<int>(dtype);
  TESSERA_CHECK(code >= 1 && code <= 8, "Megatron writer '", prefix, "': unknown dtype code ", code);
  impl_ = std::make_unique<Impl>(prefix, dtype);
}

IndexedDatasetWriter::~IndexedDatasetWriter() = default;

void IndexedDatasetWriter::add_sequence(std::span<const int32_t> tokens) {
  Impl& w = *impl_;
  TESSERA_CHECK(!w.finalized, "Megatron writer '", w.prefix, "': add_sequence after finalize");
  TESSERA_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()), "Megatron writer '",
                w.prefix, "': a sequence of ", tokens.size(), " tokens does not fit the int32 length field");
  for (size_t i = 0; i < tokens.size(); ++i) {
    TESSERA_CHECK(fits(w.dtype, tokens[i]), "Megatron writer '", w.prefix, "': token ", tokens[i], " (position ", i,
                  " of sequence ", w.lengths.size(), ") does not fit dtype ", indexed_dtype_name(w.dtype));
  }
  w.scratch.clear();
  switch (w.dtype) {
    case IndexedDType::U8: store_tokens<uint8_t>(tokens, w.scratch); break;
    case IndexedDType::I8: store_tokens<int8_t>(tokens, w.scratch); break;
    case IndexedDType::I16: store_tokens<int16_t>(tokens, w.scratch); break;
    case IndexedDType::I32: store_tokens<int32_t>(tokens, w.scratch); break;
    case IndexedDType::I64: store_tokens<int64_t>(tokens, w.scratch); break;
    case IndexedDType::F64: store_tokens<double>(tokens, w.scratch); break;
    case IndexedDType::F32: store_tokens<float>(tokens, w.scratch); break;
    case IndexedDType::U16: store_tokens<uint16_t>(tokens, w.scratch); break;
  }
  w.bin.write(w.scratch.data(), w.scratch.size());
  w.lengths.push_back(static_cast<int32_t>(tokens.size()));
}

void IndexedDatasetWriter::end_document() {
  TESSERA_CHECK(!impl_->finalized, "Megatron writer '", impl_->prefix, "': end_document after finalize");
  impl_->document_indices.push_back(static_cast<int64_t>(impl_->lengths.size()));
}

void IndexedDatasetWriter::finalize() {
  Impl& w = *impl_;
  TESSERA_CHECK(!w.finalized, "Megatron writer '", w.prefix, "': finalize called twice");
  if (w.document_indices.back() != static_cast<int64_t>(w.lengths.size())) end_document();

  AtomicFileWriter idx(w.prefix + ".idx");
  const uint64_t version = 1, num_sequences = w.lengths.size(), num_docs = w.document_indices.size();
  const uint8_t code = static_cast<uint8_t>(w.dtype);
  idx.write(kIndexMagic, sizeof(kIndexMagic));
  idx.write(&version, 8);
  idx.write(&code, 1);
  idx.write(&num_sequences, 8);
  idx.write(&num_docs, 8);
  idx.write(w.lengths.data(), w.lengths.size() * 4);
  const int64_t item = static_cast<int64_t>(indexed_dtype_size(w.dtype));
  std::vector<int64_t> pointers(w.lengths.size());
  int64_t pointer = 0;
  for (size_t i = 0; i < w.lengths.size(); ++i) {
    pointers[i] = pointer;
    pointer += w.lengths[i] * item;
  }
  idx.write(pointers.data(), pointers.size() * 8);
  idx.write(w.document_indices.data(), w.document_indices.size() * 8);

  // Both files are on disk before either is renamed, and the .bin is renamed first: a
  // visible .idx always has its complete .bin.
  w.bin.sync();
  idx.sync();
  w.bin.commit_rename();
  idx.commit_rename();
  w.finalized = true;
}

}  // namespace tessera::data
