// PNG encoding of 8-bit RGB images: the signature, then IHDR, IDAT and IEND chunks, each
// framed as length (big-endian) + type + data + CRC-32 of type and data. The IDAT payload
// is the zlib stream (compress2) of the rows, each preceded by its filter byte.
#include "tessera/io/png.h"

#include <zlib.h>

#include <algorithm>
#include <cmath>

#include "tessera/core/error.h"
#include "tessera/io/atomic_file.h"

namespace tessera::io {

Image::Image(int width, int height, Rgb fill) : width_(width), height_(height) {
  TESSERA_CHECK(width > 0 && height > 0 && width <= kMaxSide && height <= kMaxSide, "Image: size ", width, "x",
                height, " is outside 1..", kMaxSide, " per side");
  pixels_.resize(static_cast<size_t>(width) * height * 3);
  for (size_t i = 0; i < pixels_.size(); i += 3) {
    pixels_[i] = fill.r, pixels_[i + 1] = fill.g, pixels_[i + 2] = fill.b;
  }
}

void Image::blend(int x, int y, Rgb c, float alpha) {
  if (!contains(x, y) || !(alpha > 0)) return;
  alpha = std::min(alpha, 1.0f);
  uint8_t* p = &pixels_[offset(x, y)];
  const uint8_t src[3] = {c.r, c.g, c.b};
  for (int k = 0; k < 3; ++k) p[k] = static_cast<uint8_t>(std::lround(p[k] + (src[k] - p[k]) * alpha));
}

namespace {

void append_u32(std::string& out, uint32_t v) {
  out.push_back(static_cast<char>(v >> 24));
  out.push_back(static_cast<char>(v >> 16));
  out.push_back(static_cast<char>(v >> 8));
  out.push_back(static_cast<char>(v));
}

void append_chunk(std::string& out, const char type[4], const std::string& data) {
  append_u32(out, static_cast<uint32_t>(data.size()));
  const size_t type_at = out.size();
  out.append(type, 4);
  out += data;
  // The CRC covers the type and the data, not the length.
  const uLong crc = crc32_z(0L, reinterpret_cast<const Bytef*>(out.data() + type_at), 4 + data.size());
  append_u32(out, static_cast<uint32_t>(crc));
}

}  // namespace

std::string encode_png(const Image& image) {
  const int w = image.width(), h = image.height();
  TESSERA_CHECK(w > 0 && h > 0, "encode_png: empty image (", w, "x", h, ")");
  const size_t row_bytes = static_cast<size_t>(w) * 3;
  TESSERA_CHECK(image.pixels().size() == row_bytes * h, "encode_png: a ", w, "x", h, " image needs ", row_bytes * h,
                " pixel bytes, the buffer holds ", image.pixels().size());

  std::string raw;
  raw.reserve((row_bytes + 1) * h);
  for (int y = 0; y < h; ++y) {
    raw.push_back('\0');  // filter type 0: the row as is
    raw.append(reinterpret_cast<const char*>(image.pixels().data()) + y * row_bytes, row_bytes);
  }
  uLongf compressed_size = compressBound(static_cast<uLong>(raw.size()));
  std::string compressed(compressed_size, '\0');
  const int rc = compress2(reinterpret_cast<Bytef*>(compressed.data()), &compressed_size,
                           reinterpret_cast<const Bytef*>(raw.data()), static_cast<uLong>(raw.size()), 6);
  TESSERA_CHECK(rc == Z_OK, "encode_png: zlib compress2 failed with code ", rc, " on a ", w, "x", h, " image");
  compressed.resize(compressed_size);

  std::string header;
  append_u32(header, static_cast<uint32_t>(w));
  append_u32(header, static_cast<uint32_t>(h));
  header += std::string{'\x08', '\x02', '\0', '\0', '\0'};  // 8 bits, truecolour, deflate, filter 0, no interlace

  std::string png = "\x89PNG\r\n\x1a\n";
  append_chunk(png, "IHDR", header);
  append_chunk(png, "IDAT", compressed);
  append_chunk(png, "IEND", "");
  return png;
}

void write_png(const std::string& path, const Image& image) {
  const std::string bytes = encode_png(image);
  write_file_atomically(path, bytes);
}

}  // namespace tessera::io
