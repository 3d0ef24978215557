// Tests of the tokenizers: ByteTokenizer, GPT-2's byte-level alphabet and pre-tokenization,
// and Gpt2BpeTokenizer on a small hand-built vocabulary (no GPT-2 files can be fetched
// here), compared with Hugging Face's `tokenizers` when Python has it.
#include "tessera/data/tokenizer.h"

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "data_testing.h"

using namespace tessera;
using namespace tessera::data;
using namespace tessera::testing;

namespace {

const std::string G = "\xC4\xA0";  // "Ġ" (U+0120), GPT-2's symbol for the space byte

// The 256 byte symbols with GPT-2's own ids (printable bytes first, in byte order, then
// the others), then one token per merge (ids 256, 257, ...), then <|endoftext|>.
struct TinyBpe {
  std::string vocab_json, merges_txt;
};

TinyBpe make_tiny_bpe(const std::vector<std::pair<std::string, std::string>>& merges, bool with_eot = true) {
  nlohmann::json vocab = nlohmann::json::object();
  int32_t next = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      if (printable == (pass == 0)) vocab[gpt2_byte_to_unicode(static_cast<uint8_t>(b))] = next++;
    }
  }
  std::string merges_txt = "#version: 0.2\n";
  for (const auto& [left, right] : merges) {
    if (!vocab.contains(left + right)) vocab[left + right] = next++;
    merges_txt += left + " " + right + "\n";
  }
  if (with_eot) vocab[std::string(kEndOfText)] = next++;
  return {vocab.dump(), merges_txt};
}

// Merges for the hand-computed cases; their tokens get ids 256 + rank.
const std::vector<std::pair<std::string, std::string>> kTinyMerges = {
    {G, "t"},       // 256 "Ġt"
    {"h", "e"},     // 257 "he"
    {G + "t", "he"},  // 258 "Ġthe"
    {"i", "n"},     // 259 "in"
    {"l", "l"},     // 260 "ll"
    {"e", "ll"},    // 261 "ell"
    {"he", "ll"},   // 262 "hell"
};

std::unique_ptr<Gpt2BpeTokenizer> tiny_tokenizer() {
  const TinyBpe files = make_tiny_bpe(kTinyMerges);
  return Gpt2BpeTokenizer::from_strings(files.vocab_json, files.merges_txt);
}

std::string random_bytes(std::mt19937& rng, size_t max_length) {
  std::uniform_int_distribution<size_t> length(0, max_length);
  std::uniform_int_distribution<int> byte(0, 255);
  std::string s(length(rng), '\0');
  for (char& c : s) c = static_cast<char>(byte(rng));
  return s;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Valid UTF-8 text mixing scripts, digits, marks, symbols, emoji and white space, from
// blocks whose characters were all assigned long before Unicode 14 (so any Unicode
// database version classifies them alike).
std::string random_text(std::mt19937& rng, size_t max_chars) {
  static const std::vector<std::pair<char32_t, char32_t>> kBlocks = {
      {0x20, 0x7E},     {0x20, 0x7E},     {0x20, 0x7E},   {0xA0, 0xFF},     {0x100, 0x17F},  {0x391, 0x3A1},
      {0x3B1, 0x3C9},   {0x410, 0x44F},   {0x5D0, 0x5EA}, {0x620, 0x64A},   {0x660, 0x669},  {0x900, 0x939},
      {0x93E, 0x94D},   {0x966, 0x96F},   {0x2000, 0x200A}, {0x2010, 0x2027}, {0x2160, 0x2188}, {0x2200, 0x22FF},
      {0x3000, 0x3003}, {0x3041, 0x3096}, {0x4E00, 0x9FA5}, {0xAC00, 0xD7A3}, {0xFF10, 0xFF5A}, {0x1F300, 0x1F5FF},
      {0x1D400, 0x1D454}};
  static const std::vector<std::string> kFrequent = {" ", " ", "  ", "\n", "\t", "'s", "'ll", "'", "0", "7"};
  std::uniform_int_distribution<size_t> length(0, max_chars), block(0, kBlocks.size() - 1),
      frequent(0, kFrequent.size() - 1);
  std::uniform_int_distribution<int> coin(0, 3);
  std::string s;
  const size_t n = length(rng);
  for (size_t i = 0; i < n; ++i) {
    if (coin(rng) == 0) {
      s += kFrequent[frequent(rng)];
      continue;
    }
    const auto [first, last] = kBlocks[block(rng)];
    append_utf8(s, std::uniform_int_distribution<char32_t>(first, last)(rng));
  }
  return s;
}

std::vector<std::string> to_strings(const std::vector<std::string_view>& pieces) {
  return std::vector<std::string>(pieces.begin(), pieces.end());
}

}  // namespace

// ---- ByteTokenizer -------------------------------------------------------------------------

TEST(ByteTokenizer, EncodesBytesAndEndOfText) {
  ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 257);
  EXPECT_EQ(tok.eot_id(), 256);
  EXPECT_FALSE(tok.bos_id().has_value());
  EXPECT_EQ(tok.name(), "byte");
  EXPECT_EQ(tok.encode("Ab\xFF"), (std::vector<int32_t>{65, 98, 255}));
  EXPECT_EQ(tok.encode(""), std::vector<int32_t>{});
  // Plain encode never produces the control token; encode_with_special does.
  EXPECT_EQ(tok.encode("<|endoftext|>").size(), kEndOfText.size());
  EXPECT_EQ(tok.encode_with_special("a<|endoftext|>b<|endoftext|>"), (std::vector<int32_t>{97, 256, 98, 256}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{104, 105, 256}), "hi<|endoftext|>");
}

TEST(ByteTokenizer, RoundTripsAnyBytes) {
  ByteTokenizer tok;
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) {
    const std::string s = random_bytes(rng, 64);
    EXPECT_EQ(tok.decode(tok.encode(s)), s);
  }
}

TEST(ByteTokenizer, DecodeRejectsIdsOutsideTheVocabulary) {
  ByteTokenizer tok;
  expect_error([&] { tok.decode(std::vector<int32_t>{1, 257}); }, {"257", "position 1"});
  expect_error([&] { tok.decode(std::vector<int32_t>{-1}); }, {"-1"});
}

// ---- GPT-2's alphabet and pre-tokenization -------------------------------------------------

TEST(Gpt2Alphabet, MatchesBytesToUnicode) {
  EXPECT_EQ(gpt2_byte_to_unicode('a'), "a");
  EXPECT_EQ(gpt2_byte_to_unicode('!'), "!");
  EXPECT_EQ(gpt2_byte_to_unicode(' '), G);                 // U+0120
  EXPECT_EQ(gpt2_byte_to_unicode('\n'), "\xC4\x8A");       // U+010A "Ċ"
  EXPECT_EQ(gpt2_byte_to_unicode(0), "\xC4\x80");          // U+0100 "Ā"
  EXPECT_EQ(gpt2_byte_to_unicode(0x7F), "\xC4\xA1");       // U+0121
  EXPECT_EQ(gpt2_byte_to_unicode(0xAD), "\xC5\x83");       // U+0143, the last extra
  EXPECT_EQ(gpt2_byte_to_unicode(0xE9), "\xC3\xA9");       // printable Latin-1 maps to itself
  std::set<std::string> symbols;
  for (int b = 0; b < 256; ++b) symbols.insert(gpt2_byte_to_unicode(static_cast<uint8_t>(b)));
  EXPECT_EQ(symbols.size(), 256u);
}

TEST(Gpt2PreTokenize, MatchesThePatternOnEdgeCases) {
  // Expected splits are those of Python's `regex` module with GPT-2's pattern.
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"I'm here, they're 42 cats!", {"I", "'m", " here", ",", " they", "'re", " 42", " cats", "!"}},
      {"Hello   world", {"Hello", "  ", " world"}},
      {"trailing   ", {"trailing", "   "}},
      {"a\n\nb", {"a", "\n", "\n", "b"}},
      {" \n hi", {" \n", " hi"}},
      {"abc123def 4567", {"abc", "123", "def", " 4567"}},
      {"x...!?y $%^", {"x", "...!?", "y", " $%^"}},
      {"h\xC3\xA9llo w\xC3\xB6rld", {"h\xC3\xA9llo", " w\xC3\xB6rld"}},
      {"\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E", {"\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E"}},  // 日本語
      {"\xD0\xBF\xD1\x80\xD0\xB8 \xD0\xBC\xD0\xB8\xD1\x80", {"\xD0\xBF\xD1\x80\xD0\xB8", " \xD0\xBC\xD0\xB8\xD1\x80"}},
      {"I \xE2\x9D\xA4\xEF\xB8\x8F \xF0\x9F\x8D\x95!", {"I", " \xE2\x9D\xA4\xEF\xB8\x8F", " \xF0\x9F\x8D\x95!"}},
      {"DON'T", {"DON", "'", "T"}},
      {"'s'sup 'll've", {"'s", "'s", "up", " '", "ll", "'ve"}},
      {"\xD9\xA3\xD9\xA4 \xE2\x85\xAB \xC2\xBDx", {"\xD9\xA3\xD9\xA4", " \xE2\x85\xAB", " \xC2\xBD", "x"}},  // ٣٤ Ⅻ ½
      {"a\xC2\xA0" "b", {"a", "\xC2\xA0", "b"}},                   // no-break space is \s
      {"a\xE3\x80\x80 b", {"a", "\xE3\x80\x80", " b"}},            // ideographic space
      {"tab\tsep\t\tx", {"tab", "\t", "sep", "\t", "\t", "x"}},
      {"end\n", {"end", "\n"}},
      {"  lead", {" ", " lead"}},
      {"x  \n  y", {"x", "  \n ", " y"}},
      {"e\xCC\x81t\xC3\xA9", {"e", "\xCC\x81", "t\xC3\xA9"}},       // a combining mark is not a letter
      {"a1b2", {"a", "1", "b", "2"}},
      {" 3.14", {" 3", ".", "14"}},
      {"\r\n", {"\r\n"}},
      {"", {}},
  };
  for (const auto& [text, expected] : cases) {
    EXPECT_EQ(to_strings(gpt2_pre_tokenize(text)), expected) << "text: '" << text << "'";
  }
}

TEST(Gpt2PreTokenize, InvalidUtf8BytesAreOtherCharacters) {
  EXPECT_EQ(to_strings(gpt2_pre_tokenize("\xFF\xFE" "ab")), (std::vector<std::string>{"\xFF\xFE", "ab"}));
  EXPECT_EQ(to_strings(gpt2_pre_tokenize(" \xC3")), (std::vector<std::string>{" \xC3"}));  // truncated sequence
  EXPECT_EQ(to_strings(gpt2_pre_tokenize("a\xED\xA0\x80" "b")),                            // a surrogate
            (std::vector<std::string>{"a", "\xED\xA0\x80", "b"}));
  EXPECT_EQ(to_strings(gpt2_pre_tokenize("\xC0\xAF")), (std::vector<std::string>{"\xC0\xAF"}));  // overlong
}

TEST(Gpt2PreTokenize, PiecesConcatenateToTheInput) {
  std::mt19937 rng(11);
  for (int i = 0; i < 500; ++i) {
    const std::string s = i % 2 ? random_bytes(rng, 80) : random_text(rng, 40);
    std::string joined;
    for (std::string_view piece : gpt2_pre_tokenize(s)) {
      EXPECT_FALSE(piece.empty());
      joined += piece;
    }
    EXPECT_EQ(joined, s);
  }
}

TEST(UnicodeClasses, SpotChecks) {
  for (char32_t cp : {U'a', U'Z', U'\u00E9', U'\u03A9', U'\u0416', U'\u05D0', U'\u4E2D', U'\uAC00', U'\u3042', U'\U0001D400'}) {
    EXPECT_TRUE(unicode_is_letter(cp)) << std::hex << uint32_t(cp);
    EXPECT_FALSE(unicode_is_number(cp));
  }
  for (char32_t cp : {U'0', U'9', U'\u0663', U'\u0966', U'\u00BD', U'\u2160', U'\uFF11', U'\u00B2'}) {
    EXPECT_TRUE(unicode_is_number(cp)) << std::hex << uint32_t(cp);
    EXPECT_FALSE(unicode_is_letter(cp));
  }
  for (char32_t cp : {U'!', U'\'', U'\u0301', U'\u2764', U'\U0001F355', U'\u200D', U' ', U'\u3000'}) {
    EXPECT_FALSE(unicode_is_letter(cp) || unicode_is_number(cp)) << std::hex << uint32_t(cp);
  }
  for (char32_t cp : {U' ', U'\t', U'\n', U'\v', U'\f', U'\r', U'\u0085', U'\u00A0', U'\u2003', U'\u3000'}) {
    EXPECT_TRUE(unicode_is_space(cp)) << std::hex << uint32_t(cp);
  }
  EXPECT_FALSE(unicode_is_space(U'\u200B'));  // zero-width space is not White_Space
  EXPECT_FALSE(unicode_is_space(U'x'));
}

// ---- Gpt2BpeTokenizer on a tiny vocabulary -------------------------------------------------

TEST(Gpt2Bpe, LoadsTinyVocabulary) {
  auto tok = tiny_tokenizer();
  EXPECT_EQ(tok->vocab_size(), 256 + 7 + 1);
  EXPECT_EQ(tok->num_merges(), 7);
  EXPECT_EQ(tok->eot_id(), 263);
  EXPECT_EQ(tok->bos_id(), 263);
  EXPECT_EQ(tok->name(), "gpt2-bpe");
  EXPECT_EQ(tok->token_to_id(G + "the"), 258);
  EXPECT_FALSE(tok->token_to_id("nope").has_value());
}

TEST(Gpt2Bpe, SingleBytesHaveGpt2Ids) {
  auto tok = tiny_tokenizer();
  // GPT-2's real vocabulary gives these same ids to its byte symbols.
  EXPECT_EQ(tok->encode("!"), std::vector<int32_t>{0});
  EXPECT_EQ(tok->encode("a"), std::vector<int32_t>{64});
  EXPECT_EQ(tok->encode(" "), std::vector<int32_t>{220});
  EXPECT_EQ(tok->encode("\n"), std::vector<int32_t>{198});
}

TEST(Gpt2Bpe, HandComputedMerges) {
  auto tok = tiny_tokenizer();
  // h=71 e=68 l=75 o=78 j=73 n=77 i=72 (byte - 33).
  // hello: (h,e) rank 1 first, then (l,l) rank 4, then (he,ll) rank 6 -> hell o.
  EXPECT_EQ(tok->encode("hello"), (std::vector<int32_t>{262, 78}));
  // jello: (l,l), then (e,ll) -> j ell o.
  EXPECT_EQ(tok->encode("jello"), (std::vector<int32_t>{73, 261, 78}));
  // " the": (Ġ,t), (h,e), (Ġt,he).
  EXPECT_EQ(tok->encode(" the"), std::vector<int32_t>{258});
  // Merges apply left to right without overlap.
  EXPECT_EQ(tok->encode("lll"), (std::vector<int32_t>{260, 75}));
  EXPECT_EQ(tok->encode("inn"), (std::vector<int32_t>{259, 77}));
  // Merges never cross pre-token boundaries: "the" has no leading space, so no Ġt.
  EXPECT_EQ(tok->encode("hello the"), (std::vector<int32_t>{262, 78, 258}));
  EXPECT_EQ(tok->encode("the"), (std::vector<int32_t>{83, 257}));  // t=83
  EXPECT_EQ(tok->decode(tok->encode("hello the")), "hello the");
}

TEST(Gpt2Bpe, EndOfTextOnlyWithSpecialEncoding) {
  auto tok = tiny_tokenizer();
  const std::string text = "hello<|endoftext|> the";
  EXPECT_EQ(tok->encode_with_special(text), (std::vector<int32_t>{262, 78, 263, 258}));
  const std::vector<int32_t> plain = tok->encode(text);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 263), 0);
  EXPECT_EQ(tok->decode(plain), text);
  EXPECT_EQ(tok->decode(tok->encode_with_special(text)), text);
  // Without <|endoftext|> in the vocabulary there is no end-of-text id.
  const TinyBpe files = make_tiny_bpe(kTinyMerges, /*with_eot=*/false);
  auto no_eot = Gpt2BpeTokenizer::from_strings(files.vocab_json, files.merges_txt);
  EXPECT_FALSE(no_eot->eot_id().has_value());
  EXPECT_EQ(no_eot->encode_with_special(text), no_eot->encode(text));
}

TEST(Gpt2Bpe, RoundTripsAnyByteString) {
  auto tok = tiny_tokenizer();
  std::mt19937 rng(3);
  for (int i = 0; i < 300; ++i) {
    const std::string s = i % 3 == 0 ? random_text(rng, 30) : random_bytes(rng, 60);  // most not valid UTF-8
    const std::vector<int32_t> ids = tok->encode(s);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok->vocab_size());
    EXPECT_EQ(tok->decode(ids), s);
  }
  EXPECT_EQ(tok->decode(tok->encode(std::string("\0\0x\0", 4))), std::string("\0\0x\0", 4));
  expect_error([&] { tok->decode(std::vector<int32_t>{5, 264}); }, {"264", "position 1"});
}

TEST(Gpt2Bpe, EncodingIsThreadSafeAndCached) {
  auto tok = tiny_tokenizer();
  std::mt19937 rng(5);
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i) texts.push_back(random_text(rng, 40) + " hello the jello");
  std::vector<std::vector<int32_t>> expected;
  for (const auto& t : texts) expected.push_back(tok->encode(t));  // second pass hits the cache
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < texts.size(); ++i) mismatches[w] += tok->encode(texts[i]) != expected[i];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

// ---- Malformed files -----------------------------------------------------------------------

TEST(Gpt2Bpe, MissingFilesAreClearErrors) {
  TempDir dir;
  const TinyBpe files = make_tiny_bpe(kTinyMerges);
  write_text_file(dir.file("merges.txt"), files.merges_txt);
  write_text_file(dir.file("vocab.json"), files.vocab_json);
  expect_error([&] { Gpt2BpeTokenizer::from_files(dir.file("nope.json"), dir.file("merges.txt")); },
               {"vocab", "nope.json"});
  expect_error([&] { Gpt2BpeTokenizer::from_files(dir.file("vocab.json"), dir.file("nope.txt")); },
               {"merges", "nope.txt"});
  auto tok = Gpt2BpeTokenizer::from_files(dir.file("vocab.json"), dir.file("merges.txt"));
  EXPECT_EQ(tok->encode("hello"), (std::vector<int32_t>{262, 78}));
}

TEST(Gpt2Bpe, MalformedVocabularies) {
  const TinyBpe good = make_tiny_bpe(kTinyMerges);
  const auto load_vocab = [&](const std::string& vocab) { Gpt2BpeTokenizer::from_strings(vocab, good.merges_txt); };
  expect_error([&] { load_vocab("{\"a\": 0,"); }, {"not valid JSON"});
  expect_error([&] { load_vocab("[1, 2]"); }, {"JSON object", "array"});
  expect_error([&] { load_vocab("{}"); }, {"non-empty"});

  nlohmann::json vocab = nlohmann::json::parse(good.vocab_json);
  nlohmann::json bad = vocab;
  bad["hell"] = "262";
  expect_error([&] { load_vocab(bad.dump()); }, {"must be an integer", "hell"});
  bad = vocab;
  bad["zz"] = 5;  // shares id 5 with a byte symbol
  expect_error([&] { load_vocab(bad.dump()); }, {"id 5", "two tokens"});
  bad = vocab;
  bad["zz"] = 1000;  // leaves a gap
  expect_error([&] { load_vocab(bad.dump()); }, {"1000", "0..N-1"});
  bad = vocab;
  bad.erase(G);  // the space symbol; the remaining ids leave a gap unless renumbered
  nlohmann::json renumbered = nlohmann::json::object();
  int32_t next = 0;
  std::vector<std::pair<int32_t, std::string>> by_id;
  for (const auto& [token, id] : bad.items()) by_id.emplace_back(id.get<int32_t>(), token);
  std::sort(by_id.begin(), by_id.end());
  for (const auto& entry : by_id) renumbered[entry.second] = next++;
  expect_error([&] { Gpt2BpeTokenizer::from_strings(renumbered.dump(), "#version: 0.2\n"); },
               {"lacks the symbol of byte 32"});
}

TEST(Gpt2Bpe, MalformedMerges) {
  const TinyBpe good = make_tiny_bpe(kTinyMerges);
  const auto load_merges = [&](const std::string& merges) { Gpt2BpeTokenizer::from_strings(good.vocab_json, merges); };
  expect_error([&] { load_merges("#version: 0.2\nh e\nh e l\n"); }, {"line 3", "two tokens"});
  expect_error([&] { load_merges("h e\nhe\n"); }, {"line 2"});
  expect_error([&] { load_merges("h  e\n"); }, {"line 1"});
  expect_error([&] { load_merges("#version: 0.2\nh q@@\n"); }, {"line 2", "right token", "q@@"});
  expect_error([&] { load_merges("h e\nx y\n"); }, {"line 2", "merged token", "xy"});
  // Windows line endings, blank lines and no trailing newline are accepted.
  auto tok = Gpt2BpeTokenizer::from_strings(good.vocab_json, "#version: 0.2\r\nh e\r\n\r\nl l");
  EXPECT_EQ(tok->num_merges(), 2);
  EXPECT_EQ(tok->encode("hell"), (std::vector<int32_t>{257, 260}));
}

// ---- Against Hugging Face's tokenizers -----------------------------------------------------

namespace {

bool python_has_tokenizers() { return std::system("python3 -c 'import tokenizers' >/dev/null 2>&1") == 0; }

const char* kHfScript = R"PY(
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, ByteLevelBPETokenizer
mode, workdir = sys.argv[1], sys.argv[2]
strings = json.load(open(workdir + "/strings.json", encoding="utf-8"))
if mode == "train":
    corpus = json.load(open(workdir + "/corpus.json", encoding="utf-8"))
    trainer = ByteLevelBPETokenizer(add_prefix_space=False)
    trainer.train_from_iterator(corpus, vocab_size=700, min_frequency=2, special_tokens=["<|endoftext|>"],
                                show_progress=False)
    trainer.save_model(workdir)
tok = Tokenizer(models.BPE.from_file(workdir + "/vocab.json", workdir + "/merges.txt"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
tok.decoder = decoders.ByteLevel()
plain = [tok.encode(s).ids for s in strings]
tok.add_special_tokens(["<|endoftext|>"])
special = [tok.encode(s).ids for s in strings]
json.dump({"plain": plain, "special": special}, open(workdir + "/ids.json", "w"))
)PY";

std::vector<std::string> comparison_strings() {
  std::vector<std::string> strings = {
      "hello the jello", "Hello World! It's 2024; they'll've... done?", "  leading and trailing  ",
      "multiple   spaces\n\n\nand\tnew\r\nlines \n", "numbers 1234567 3.14159 1,000,000", "don't DON'T 'tis",
      "h\xC3\xA9llo w\xC3\xB6rld \xC3\xA7" "a va", "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E\xE3\x81\xAE\xE3\x83\x86",
      "I \xE2\x9D\xA4\xEF\xB8\x8F \xF0\x9F\x8D\x95 \xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9", "a\xC2\xA0" "b\xE3\x80\x80" "c",
      "<|endoftext|>", "x<|endoftext|>y <|endoftext|> z", "", " ", "\n",
  };
  std::mt19937 rng(2024);
  for (int i = 0; i < 300; ++i) strings.push_back(random_text(rng, 60));
  return strings;
}

// Runs the Python side and compares plain and special encodings with ours.
void compare_with_hugging_face(const TempDir& dir, const std::string& mode, const std::vector<std::string>& strings) {
  write_text_file(dir.file("strings.json"), nlohmann::json(strings).dump());
  write_text_file(dir.file("hf.py"), kHfScript);
  const std::string command = "python3 '" + dir.file("hf.py") + "' " + mode + " '" + dir.path().string() + "' 2>'" +
                              dir.file("hf.err") + "'";
  ASSERT_EQ(std::system(command.c_str()), 0) << "python failed: " << read_text_file(dir.file("hf.err"));
  const nlohmann::json ids = nlohmann::json::parse(read_text_file(dir.file("ids.json")));
  auto tok = Gpt2BpeTokenizer::from_files(dir.file("vocab.json"), dir.file("merges.txt"));
  int mismatches = 0;
  for (size_t i = 0; i < strings.size(); ++i) {
    const auto want_plain = ids["plain"][i].get<std::vector<int32_t>>();
    const auto want_special = ids["special"][i].get<std::vector<int32_t>>();
    const bool ok = tok->encode(strings[i]) == want_plain && tok->encode_with_special(strings[i]) == want_special;
    EXPECT_TRUE(ok) << "string " << i << ": '" << strings[i] << "'";
    mismatches += !ok;
    EXPECT_EQ(tok->decode(want_plain), strings[i]);
  }
  EXPECT_EQ(mismatches, 0);
}

}  // namespace

TEST(Gpt2BpeHuggingFace, TinyVocabularyMatches) {
  if (!python_has_tokenizers()) GTEST_SKIP() << "python3 cannot import `tokenizers` (pip install tokenizers)";
  TempDir dir;
  const TinyBpe files = make_tiny_bpe(kTinyMerges);
  write_text_file(dir.file("vocab.json"), files.vocab_json);
  write_text_file(dir.file("merges.txt"), files.merges_txt);
  compare_with_hugging_face(dir, "load", comparison_strings());
}

TEST(Gpt2BpeHuggingFace, TrainedVocabularyMatches) {
  if (!python_has_tokenizers()) GTEST_SKIP() << "python3 cannot import `tokenizers` (pip install tokenizers)";
  TempDir dir;
  std::vector<std::string> corpus;
  std::mt19937 rng(99);
  for (int i = 0; i < 200; ++i) {
    corpus.push_back("The quick brown fox jumps over the lazy dog. It's 12:30 and they've gone. " +
                     random_text(rng, 30));
  }
  write_text_file(dir.file("corpus.json"), nlohmann::json(corpus).dump());
  std::vector<std::string> strings = comparison_strings();
  strings.insert(strings.end(), corpus.begin(), corpus.begin() + 50);
  compare_with_hugging_face(dir, "train", strings);
  auto tok = Gpt2BpeTokenizer::from_files(dir.file("vocab.json"), dir.file("merges.txt"));
  EXPECT_GT(tok->num_merges(), 100);  // the comparison really exercised merges
  EXPECT_EQ(tok->eot_id(), 0);        // Hugging Face puts special tokens first
}
