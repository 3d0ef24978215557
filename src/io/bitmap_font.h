// A 5x7 bitmap font (with two descender rows) for printable ASCII, for text in pictures
// tessera draws without a font library. Drawn for tessera; see bitmap_font.cpp.
#pragma once

#include <array>
#include <cstdint>

namespace tessera::io::font {

inline constexpr int kGlyphWidth = 5;   // columns of ink
inline constexpr int kGlyphHeight = 9;  // rows: 7 above the baseline, 2 of descender
inline constexpr int kCapHeight = 7;
inline constexpr int kAdvance = 6;      // one blank column between characters
inline constexpr int kLineHeight = 11;

// One row per entry, top to bottom; bit 4 is the leftmost column. Characters outside
// 32..126 get a hollow box.
using Glyph = std::array<uint8_t, kGlyphHeight>;
const Glyph& glyph(char c);

}  // namespace tessera::io::font
