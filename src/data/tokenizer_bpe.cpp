// Gpt2BpeTokenizer: GPT-2's byte-level BPE (OpenAI's encoder.py, Hugging Face's
// GPT2Tokenizer). Text is split by gpt2_pre_tokenize; each piece's bytes start as their
// single-symbol tokens, and the adjacent pair with the lowest merge rank is merged (every
// non-overlapping occurrence, left to right) until no pair has a merge.
//
// Tokens are handled as vocabulary ids rather than strings: a merge is the id pair
// (left, right) -> (rank, result id), which loading checks exists for every merge, so the
// outcome equals the string algorithm's and no string is built while encoding.
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tessera/core/error.h"
#include "tessera/data/tokenizer.h"

namespace tessera::data {
namespace {

// Pre-tokens are mostly words, so the cache stays small on natural text; past this many
// entries it is dropped rather than grown without bound on adversarial input.
constexpr size_t kMaxCacheEntries = 1 << 18;

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in, "gpt2 tokenizer: cannot open the ", what, " file '", path, "'");
  std::ostringstream contents;
  contents << in.rdbuf();
  TESSERA_CHECK(!in.bad(), "gpt2 tokenizer: cannot read the ", what, " file '", path, "'");
  return contents.str();
}

// What a vocabulary entry decodes to: each character mapped back through
// bytes_to_unicode. An entry with a character outside that alphabet (an added token
// written as plain text) decodes to its own UTF-8 text.
std::string token_bytes(const std::string& token, const std::unordered_map<std::string, uint8_t>& unicode_to_byte) {
  std::string bytes;
  for (size_t i = 0; i < token.size();) {
    const uint8_t lead = static_cast<uint8_t>(token[i]);
    const size_t length = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
    const auto it = unicode_to_byte.find(token.substr(i, length));
    if (it == unicode_to_byte.end()) return token;
    bytes.push_back(static_cast<char>(it->second));
    i += length;
  }
  return bytes;
}

}  // namespace

std::unique_ptr<Gpt2BpeTokenizer> Gpt2BpeTokenizer::from_files(const std::string& vocab_json_path,
                                                               const std::string& merges_txt_path) {
  const std::string vocab = read_file(vocab_json_path, "vocab");
  const std::string merges = read_file(merges_txt_path, "merges");
  return from_strings(vocab, merges, "'" + vocab_json_path + "' / '" + merges_txt_path + "'");
}

std::unique_ptr<Gpt2BpeTokenizer> Gpt2BpeTokenizer::from_strings(const std::string& vocab_json,
                                                                 const std::string& merges_txt,
                                                                 const std::string& source) {
  std::unique_ptr<Gpt2BpeTokenizer> tok(new Gpt2BpeTokenizer());

  // ---- vocab.json: a JSON object {token: id}, ids exactly 0..N-1 ----
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(vocab_json);
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("gpt2 tokenizer: the vocab of ", source, " is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(vocab.is_object() && !vocab.empty(), "gpt2 tokenizer: the vocab of ", source,
                " must be a non-empty JSON object {\"token\": id}, got a JSON ", vocab.type_name());
  const size_t n = vocab.size();
  TESSERA_CHECK(n < static_cast<size_t>(std::numeric_limits<int32_t>::max()), "gpt2 tokenizer: the vocab of ",
                source, " has too many entries (", n, ")");
  std::unordered_map<std::string, uint8_t> unicode_to_byte;
  for (int b = 0; b < 256; ++b) unicode_to_byte.emplace(gpt2_byte_to_unicode(static_cast<uint8_t>(b)), b);

  tok->id_to_bytes_.assign(n, {});
  std::vector<bool> seen(n, false);
  for (const auto& [token, value] : vocab.items()) {
    TESSERA_CHECK(value.is_number_integer(), "gpt2 tokenizer: the vocab of ", source, ": the id of token '", token,
                  "' must be an integer, got ", value.dump());
    const int64_t id = value.get<int64_t>();
    TESSERA_CHECK(id >= 0 && id < static_cast<int64_t>(n), "gpt2 tokenizer: the vocab of ", source, ": token '",
                  token, "' has id ", id, ", outside [0, ", n, "): ids must be 0..N-1 for N entries");
    TESSERA_CHECK(!seen[id], "gpt2 tokenizer: the vocab of ", source, ": id ", id,
                  " is given to two tokens (one is '", token, "')");
    seen[id] = true;
    tok->token_to_id_.emplace(token, static_cast<int32_t>(id));
    tok->id_to_bytes_[id] = token_bytes(token, unicode_to_byte);
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = tok->token_to_id_.find(gpt2_byte_to_unicode(static_cast<uint8_t>(b)));
    TESSERA_CHECK(it != tok->token_to_id_.end(), "gpt2 tokenizer: the vocab of ", source,
                  " lacks the symbol of byte ", b, " ('", gpt2_byte_to_unicode(static_cast<uint8_t>(b)),
                  "'); a byte-level vocabulary has all 256");
    tok->byte_id_[b] = it->second;
  }
  if (const auto it = tok->token_to_id_.find(std::string(kEndOfText)); it != tok->token_to_id_.end()) {
    tok->eot_id_ = it->second;
  }

  // ---- merges.txt: "left right" per line, rank = order; a "#version" first line ----
  std::istringstream lines(merges_txt);
  std::string line;
  int64_t line_number = 0;
  int32_t rank = 0;
  while (std::getline(lines, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line_number == 1 && line.rfind("#version", 0) == 0) continue;
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    TESSERA_CHECK(space != std::string::npos && space > 0 && space + 1 < line.size() &&
                      line.find(' ', space + 1) == std::string::npos,
                  "gpt2 tokenizer: merges of ", source, ", line ", line_number,
                  ": expected two tokens separated by one space, got '", line, "'");
    const std::string left = line.substr(0, space), right = line.substr(space + 1);
    const auto find_id = [&](const std::string& token, const char* role) {
      const auto it = tok->token_to_id_.find(token);
      TESSERA_CHECK(it != tok->token_to_id_.end(), "gpt2 tokenizer: merges of ", source, ", line ", line_number,
                    ": the ", role, " '", token, "' is not in the vocab");
      return it->second;
    };
    const int32_t left_id = find_id(left, "left token");
    const int32_t right_id = find_id(right, "right token");
    const int32_t result_id = find_id(left + right, "merged token");
    // A repeated pair takes its later rank, as Python's dict(zip(merges, range(...))) does.
    tok->merges_.insert_or_assign(pair_key(left_id, right_id), Merge{rank, result_id});
    ++rank;
  }
  tok->num_merges_ = rank;
  return tok;
}

std::optional<int32_t> Gpt2BpeTokenizer::token_to_id(const std::string& token) const {
  const auto it = token_to_id_.find(token);
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

std::vector<int32_t> Gpt2BpeTokenizer::bpe(std::string_view chunk) const {
  std::vector<int32_t> word(chunk.size());
  for (size_t i = 0; i < chunk.size(); ++i) word[i] = byte_id_[static_cast<uint8_t>(chunk[i])];
  std::vector<int32_t> merged;
  merged.reserve(word.size());
  while (word.size() >= 2) {
    const Merge* best = nullptr;
    uint64_t best_key = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      const uint64_t key = pair_key(word[i], word[i + 1]);
      const auto it = merges_.find(key);
      if (it != merges_.end() && (best == nullptr || it->second.rank < best->rank)) {
        best = &it->second;
        best_key = key;
      }
    }
    if (best == nullptr) break;
    merged.clear();
    for (size_t i = 0; i < word.size();) {
      if (i + 1 < word.size() && pair_key(word[i], word[i + 1]) == best_key) {
        merged.push_back(best->result);
        i += 2;
      } else {
        merged.push_back(word[i]);
        i += 1;
      }
    }
    word.swap(merged);
  }
  return word;
}

void Gpt2BpeTokenizer::encode_chunk(std::string_view chunk, std::vector<int32_t>& out) const {
  if (chunk.size() == 1) {
    out.push_back(byte_id_[static_cast<uint8_t>(chunk[0])]);
    return;
  }
  const std::string key(chunk);
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (const auto it = cache_.find(key); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids = bpe(chunk);
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_.size() >= kMaxCacheEntries) cache_.clear();
  cache_.emplace(key, std::move(ids));
}

std::vector<int32_t> Gpt2BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = gpt2_pre_token_end(text, begin);
    encode_chunk(text.substr(begin, end - begin), ids);
    begin = end;
  }
  return ids;
}

std::vector<int32_t> Gpt2BpeTokenizer::encode_with_special(std::string_view text) const {
  if (!eot_id_) return encode(text);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  size_t start = 0;
  while (true) {
    const size_t hit = text.find(kEndOfText, start);
    const std::string_view segment = text.substr(start, hit == std::string_view::npos ? text.npos : hit - start);
    const std::vector<int32_t> segment_ids = encode(segment);
    ids.insert(ids.end(), segment_ids.begin(), segment_ids.end());
    if (hit == std::string_view::npos) break;
    ids.push_back(*eot_id_);
    start = hit + kEndOfText.size();
  }
  return ids;
}

std::string Gpt2BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  text.reserve(ids.size() * 4);
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    TESSERA_CHECK(id >= 0 && id < vocab_size(), "gpt2 tokenizer: decode: id ", id, " at position ", i,
                  " is outside the vocabulary [0, ", vocab_size(), ")");
    text += id_to_bytes_[id];
  }
  return text;
}

}  // namespace tessera::data
