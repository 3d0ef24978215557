// ByteTokenizer: one id per byte (0..255) plus end-of-text (256). No vocabulary files, and
// every byte string round-trips, which makes it the tokenizer of tests and toy runs.
#include "tessera/core/error.h"
#include "tessera/data/tokenizer.h"

namespace tessera::data {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<uint8_t>(text[i]);
  return ids;
}

std::vector<int32_t> ByteTokenizer::encode_with_special(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  size_t start = 0;
  while (start <= text.size()) {
    const size_t hit = text.find(kEndOfText, start);
    const std::string_view piece = text.substr(start, hit == std::string_view::npos ? text.npos : hit - start);
    for (char c : piece) ids.push_back(static_cast<uint8_t>(c));
    if (hit == std::string_view::npos) break;
    ids.push_back(kEotId);
    start = hit + kEndOfText.size();
  }
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    TESSERA_CHECK(id >= 0 && id <= kEotId, "byte tokenizer: decode: id ", id, " at position ", i,
                  " is outside the vocabulary [0, 257)");
    if (id == kEotId) {
      text += kEndOfText;
    } else {
      text.push_back(static_cast<char>(static_cast<uint8_t>(id)));
    }
  }
  return text;
}

}  // namespace tessera::data
