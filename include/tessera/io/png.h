// RGB images and a dependency-light PNG writer (zlib only), for plots and other pictures
// tessera draws itself.
//
//   io::Image image(640, 480, io::Rgb{255, 255, 255});
//   image.set(10, 20, io::Rgb{214, 39, 40});
//   io::write_png("out.png", image);
//
// Pixels are 8-bit RGB, row-major from the top-left corner, 3 bytes per pixel.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera::io {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  friend bool operator==(const Rgb&, const Rgb&) = default;
};

class Image {
 public:
  Image() = default;
  // Error unless 0 < width, height <= kMaxSide.
  Image(int width, int height, Rgb fill = Rgb{255, 255, 255});

  static constexpr int kMaxSide = 16384;

  int width() const { return width_; }
  int height() const { return height_; }
  bool contains(int x, int y) const { return x >= 0 && y >= 0 && x < width_ && y < height_; }

  // Unchecked in release builds for speed; callers clip with contains() first.
  Rgb at(int x, int y) const {
    const uint8_t* p = &pixels_[offset(x, y)];
    return Rgb{p[0], p[1], p[2]};
  }
  void set(int x, int y, Rgb c) {
    uint8_t* p = &pixels_[offset(x, y)];
    p[0] = c.r, p[1] = c.g, p[2] = c.b;
  }
  // Mixes `c` over the pixel with opacity `alpha` in [0, 1]; pixels outside are ignored.
  void blend(int x, int y, Rgb c, float alpha);

  // width * height * 3 bytes, rows top to bottom.
  const std::vector<uint8_t>& pixels() const { return pixels_; }
  std::vector<uint8_t>& pixels() { return pixels_; }

 private:
  size_t offset(int x, int y) const { return (static_cast<size_t>(y) * width_ + x) * 3; }
  int width_ = 0, height_ = 0;
  std::vector<uint8_t> pixels_;
};

// The complete PNG file (signature, IHDR, one zlib-compressed IDAT, IEND) for `image`:
// 8-bit truecolour, no interlace, filter type 0 on every row. Error for an empty image or
// one whose pixel buffer does not hold width * height * 3 bytes.
std::string encode_png(const Image& image);

// Writes encode_png(image) to `path` atomically (temporary file in the same directory, then
// rename), so a reader never sees a half-written picture. Error naming the path on failure.
void write_png(const std::string& path, const Image& image);

}  // namespace tessera::io
