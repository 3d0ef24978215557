// Tokenizers: text <-> token ids.
//
// Two are built in:
//   ByteTokenizer     ids 0..255 are the bytes, 256 is end-of-text; needs no files.
//   Gpt2BpeTokenizer  GPT-2's byte-level BPE (the same ids as OpenAI's encoder.py and
//                     Hugging Face's GPT2Tokenizer), read from vocab.json + merges.txt.
//
// Both work on bytes, so decode(encode(s)) == s for every byte string, valid UTF-8 or not.
// encode() treats its input as plain text: a literal "<|endoftext|>" in it is encoded as
// the characters it spells, so untrusted text can never inject a control token.
// encode_with_special() maps each literal "<|endoftext|>" to the end-of-text id, which is
// what Hugging Face's tokenizers do by default.
//
// All methods are const and safe to call from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tessera::data {

// The text of GPT-2's end-of-text token, also used by ByteTokenizer.
inline constexpr std::string_view kEndOfText = "<|endoftext|>";

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  virtual std::vector<int32_t> encode_with_special(std::string_view text) const = 0;
  // Throws Error on an id outside [0, vocab_size()).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;

  virtual int32_t vocab_size() const = 0;
  virtual std::optional<int32_t> eot_id() const = 0;  // end of text (document separator)
  virtual std::optional<int32_t> bos_id() const = 0;  // beginning of sequence, when the scheme has one
  virtual std::string name() const = 0;
};

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kEotId = 256;

  std::vector<int32_t> encode(std::string_view text) const override;
  std::vector<int32_t> encode_with_special(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;  // 256 decodes to "<|endoftext|>"
  int32_t vocab_size() const override { return 257; }
  std::optional<int32_t> eot_id() const override { return kEotId; }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  std::string name() const override { return "byte"; }
};

class Gpt2BpeTokenizer final : public Tokenizer {
 public:
  // vocab.json: {"token": id, ...} with ids exactly 0..N-1; merges.txt: an optional
  // "#version" first line, then one "left right" pair per line, highest priority first.
  // Throws Error naming the file (and, for merges, the line) when a file is missing or
  // malformed, when ids are not 0..N-1 each once, or when one of the 256 byte symbols, or a
  // merge's parts or result, is missing from the vocabulary.
  static std::unique_ptr<Gpt2BpeTokenizer> from_files(const std::string& vocab_json_path,
                                                      const std::string& merges_txt_path);
  // The same from the files' contents; `source` names them in error messages.
  static std::unique_ptr<Gpt2BpeTokenizer> from_strings(const std::string& vocab_json, const std::string& merges_txt,
                                                        const std::string& source = "<memory>");

  std::vector<int32_t> encode(std::string_view text) const override;
  std::vector<int32_t> encode_with_special(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(id_to_bytes_.size()); }
  // GPT-2 uses <|endoftext|> for both, when the vocabulary has it.
  std::optional<int32_t> eot_id() const override { return eot_id_; }
  std::optional<int32_t> bos_id() const override { return eot_id_; }
  std::string name() const override { return "gpt2-bpe"; }

  int64_t num_merges() const { return num_merges_; }
  // The id of a vocabulary entry (spelled in the byte-to-unicode alphabet, e.g. "Ġthe").
  std::optional<int32_t> token_to_id(const std::string& token) const;

 private:
  Gpt2BpeTokenizer() = default;
  // Byte-pair merges of one pre-token; results are cached per pre-token.
  void encode_chunk(std::string_view chunk, std::vector<int32_t>& out) const;
  std::vector<int32_t> bpe(std::string_view chunk) const;

  struct Merge {
    int32_t rank;
    int32_t result;
  };
  std::unordered_map<std::string, int32_t> token_to_id_;
  std::vector<std::string> id_to_bytes_;    // what each id decodes to
  int32_t byte_id_[256] = {};               // the single-symbol token of each byte
  std::unordered_map<uint64_t, Merge> merges_;  // key: (left id << 32) | right id
  int64_t num_merges_ = 0;
  std::optional<int32_t> eot_id_;

  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

// ---- The pieces of GPT-2's byte-level scheme, public for tests and tools ----

// GPT-2's bytes_to_unicode(): byte b -> a printable code point (printable Latin-1 bytes map
// to themselves, the others to U+0100 + k), as UTF-8.
const std::string& gpt2_byte_to_unicode(uint8_t byte);

// Splits text with GPT-2's pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// The pieces concatenate to the input exactly. Bytes that are not valid UTF-8 count as
// single "other" characters (neither letter, number nor space).
std::vector<std::string_view> gpt2_pre_tokenize(std::string_view text);
// The end (byte offset) of the piece that starts at byte `begin`: the same split one piece
// at a time, without building the list (what encode() uses on long texts).
size_t gpt2_pre_token_end(std::string_view text, size_t begin);

// Unicode classes used by the pattern: general category L*, N*, and White_Space, for
// every code point, from tables of the Unicode 17 database (scripts/gen_unicode_tables.py).
// Python's `regex` module splits identically; Hugging Face's tokenizers (Unicode 16)
// differ only on characters new in Unicode 17.
bool unicode_is_letter(char32_t cp);
bool unicode_is_number(char32_t cp);
bool unicode_is_space(char32_t cp);

}  // namespace tessera::data
