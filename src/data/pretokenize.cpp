// GPT-2's byte-level alphabet and its pre-tokenization pattern, written out by hand.
//
// The pattern 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// needs Unicode classes std::regex does not have, so the text is decoded to code points as
// it is scanned, each classified as letter, number, space or other, and the alternatives
// are tried in the regex's order at every position, with the same greedy and backtracking
// outcome. Nothing proportional to the text is allocated.
#include <array>

#include "tessera/data/tokenizer.h"

namespace tessera::data {
namespace {

enum class CharClass : uint8_t { Letter, Number, Space, Other };

struct Char {
  char32_t cp;     // 0xFFFFFFFF for a byte that is not valid UTF-8
  uint8_t length;  // bytes of its UTF-8 encoding (1 for an invalid byte)
  CharClass cls;
};

constexpr char32_t kInvalid = 0xFFFFFFFFu;

// Strict UTF-8 (no overlong forms, no surrogates, nothing past U+10FFFF). A byte that does
// not start a valid sequence becomes one invalid character, so every byte string splits.
char32_t decode_utf8(std::string_view s, size_t i, uint8_t& length) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t b0 = byte(i);
  length = 1;
  if (b0 < 0x80) return b0;
  int extra;
  char32_t cp, min;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    extra = 1, cp = b0 & 0x1F, min = 0x80;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    extra = 2, cp = b0 & 0x0F, min = 0x800;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    extra = 3, cp = b0 & 0x07, min = 0x10000;
  } else {
    return kInvalid;
  }
  if (i + extra >= s.size()) return kInvalid;
  for (int k = 1; k <= extra; ++k) {
    const uint8_t b = byte(i + k);
    if ((b & 0xC0) != 0x80) return kInvalid;
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return kInvalid;
  length = static_cast<uint8_t>(extra + 1);
  return cp;
}

CharClass classify(char32_t cp) {
  if (cp == kInvalid) return CharClass::Other;
  if (unicode_is_letter(cp)) return CharClass::Letter;
  if (unicode_is_number(cp)) return CharClass::Number;
  if (unicode_is_space(cp)) return CharClass::Space;
  return CharClass::Other;
}

// The character at byte offset i (i < text.size()).
Char char_at(std::string_view text, size_t i) {
  Char c;
  c.cp = decode_utf8(text, i, c.length);
  c.cls = classify(c.cp);
  return c;
}

// Bytes of the contraction at byte offset i ('s 't 're 've 'm 'll 'd, ASCII only), or 0.
size_t contraction_length(std::string_view text, size_t i) {
  const auto at = [&](size_t j) { return j < text.size() ? text[j] : '\0'; };
  if (at(i) != '\'') return 0;
  const char c1 = at(i + 1), c2 = at(i + 2);
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

std::array<std::string, 256> make_byte_to_unicode() {
  std::array<std::string, 256> table;
  int next_extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const char32_t cp = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next_extra++);
    // Every code point here is below U+0800: one or two UTF-8 bytes.
    if (cp < 0x80) {
      table[b] = std::string(1, static_cast<char>(cp));
    } else {
      table[b] = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    }
  }
  return table;
}

}  // namespace

const std::string& gpt2_byte_to_unicode(uint8_t byte) {
  static const std::array<std::string, 256> table = make_byte_to_unicode();
  return table[byte];
}

size_t gpt2_pre_token_end(std::string_view text, size_t begin) {
  const size_t n = text.size();
  if (begin >= n) return n;
  if (const size_t c = contraction_length(text, begin)) return begin + c;
  const Char first = char_at(text, begin);
  // " ?X+" for X in letter, number, other: an optional U+0020, then a maximal run of X.
  for (CharClass x : {CharClass::Letter, CharClass::Number, CharClass::Other}) {
    size_t run = begin;
    Char c = first;
    if (first.cp == U' ' && begin + 1 < n) {
      const Char next = char_at(text, begin + 1);
      if (next.cls == x) run = begin + 1, c = next;
    }
    if (c.cls != x) continue;
    while (run < n && c.cls == x) {
      run += c.length;
      if (run < n) c = char_at(text, run);
    }
    return run;
  }
  // White space. \s+(?!\S): the run, less its last character when a non-space follows;
  // if that leaves nothing, \s+ takes the single character.
  size_t end = begin, last = begin, count = 0;
  while (end < n) {
    const Char c = char_at(text, end);
    if (c.cls != CharClass::Space) break;
    last = end;
    end += c.length;
    ++count;
  }
  if (end == n || count == 1) return end;
  return last;
}

std::vector<std::string_view> gpt2_pre_tokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = gpt2_pre_token_end(text, begin);
    pieces.push_back(text.substr(begin, end - begin));
    begin = end;
  }
  return pieces;
}

}  // namespace tessera::data
