// tessera plot: the PNG writer (decoded back here with zlib and compared pixel by pixel),
// the metrics.jsonl reader (resumes, malformed lines), tick computation and the chart.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include "io/bitmap_font.h"
#include "tessera/core/error.h"
#include "tessera/io/atomic_file.h"
#include "tessera/io/plot.h"

using namespace tessera;
using namespace tessera::io;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() / ("tessera_plot_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string write(const std::string& relative, const std::string& text) const {
    const fs::path file = path / relative;
    fs::create_directories(file.parent_path());
    std::ofstream(file, std::ios::binary) << text;
    return file.string();
  }
};

uint32_t read_u32(const std::string& s, size_t at) {
  return uint32_t(uint8_t(s[at])) << 24 | uint32_t(uint8_t(s[at + 1])) << 16 | uint32_t(uint8_t(s[at + 2])) << 8 |
         uint32_t(uint8_t(s[at + 3]));
}

// A strict reader for the PNGs write_png makes: checks the signature, the chunk order and
// every CRC, then inflates IDAT and undoes filter 0. Fails the test on anything else.
struct DecodedPng {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
};

DecodedPng decode_png(const std::string& png) {
  DecodedPng out;
  EXPECT_GE(png.size(), 8u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << "bad PNG signature";
  std::vector<std::string> types;
  std::string idat;
  size_t at = 8;
  while (at + 12 <= png.size()) {
    const uint32_t length = read_u32(png, at);
    EXPECT_LE(at + 12 + length, png.size()) << "chunk runs past the end";
    if (at + 12 + length > png.size()) return out;
    const std::string type = png.substr(at + 4, 4);
    const std::string data = png.substr(at + 8, length);
    const uint32_t crc = read_u32(png, at + 8 + length);
    const uLong want = crc32(0L, reinterpret_cast<const Bytef*>(png.data() + at + 4), 4 + length);
    EXPECT_EQ(crc, uint32_t(want)) << "bad CRC on chunk " << type;
    types.push_back(type);
    if (type == "IHDR") {
      EXPECT_EQ(length, 13u);
      out.width = int(read_u32(data, 0)), out.height = int(read_u32(data, 4));
      EXPECT_EQ(data[8], 8) << "bit depth";
      EXPECT_EQ(data[9], 2) << "colour type (truecolour)";
      EXPECT_EQ(data.substr(10), std::string(3, '\0')) << "compression, filter and interlace methods";
    }
    if (type == "IDAT") idat += data;
    at += 12 + length;
  }
  EXPECT_EQ(at, png.size()) << "trailing bytes after the last chunk";
  EXPECT_EQ(types.front(), "IHDR");
  EXPECT_EQ(types.back(), "IEND");
  const size_t row = size_t(out.width) * 3 + 1;
  std::vector<uint8_t> raw(row * out.height);
  uLongf raw_size = raw.size();
  EXPECT_EQ(uncompress(raw.data(), &raw_size, reinterpret_cast<const Bytef*>(idat.data()), idat.size()), Z_OK);
  EXPECT_EQ(raw_size, raw.size());
  for (int y = 0; y < out.height; ++y) {
    EXPECT_EQ(raw[y * row], 0) << "filter type of row " << y;
    out.rgb.insert(out.rgb.end(), raw.begin() + y * row + 1, raw.begin() + (y + 1) * row);
  }
  return out;
}

bool contains_colour(const Image& image, Rgb colour) {
  for (int y = 0; y < image.height(); ++y)
    for (int x = 0; x < image.width(); ++x)
      if (image.at(x, y) == colour) return true;
  return false;
}

std::string synthetic_run(int steps, double start, double floor, double noise, int val_every, uint32_t seed) {
  std::string text;
  uint32_t state = seed;
  for (int step = 1; step <= steps; ++step) {
    state = state * 1664525u + 1013904223u;
    const double jitter = (double(state >> 8) / double(1u << 24) - 0.5) * noise;
    const double loss = floor + (start - floor) * std::exp(-step / 150.0) + jitter;
    text += "{\"step\": " + std::to_string(step) + ", \"loss\": " + std::to_string(loss) + ", \"lr\": 0.0003";
    if (step % val_every == 0) text += ", \"val_loss\": " + std::to_string(floor + 0.1 + (start - floor) * std::exp(-step / 150.0));
    text += "}\n";
  }
  return text;
}

void expect_ticks(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size()) << ::testing::PrintToString(got);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12 * std::max(1.0, std::abs(want[i])));
}

}  // namespace

// ---- PNG -------------------------------------------------------------------------------

TEST(PlotPng, RoundTripsPixelsThroughZlib) {
  TempDir dir;
  Image image(37, 11, Rgb{10, 20, 30});  // odd width: rows are not 4-byte multiples
  for (int y = 0; y < image.height(); ++y)
    for (int x = 0; x < image.width(); ++x) image.set(x, y, Rgb{uint8_t(x * 7), uint8_t(y * 23), uint8_t(x ^ y)});
  const std::string path = (dir.path / "small.png").string();
  write_png(path, image);
  const std::string bytes = read_file(path);
  EXPECT_EQ(bytes, encode_png(image));
  const DecodedPng png = decode_png(bytes);
  EXPECT_EQ(png.width, 37);
  EXPECT_EQ(png.height, 11);
  EXPECT_EQ(png.rgb, image.pixels());
  // Written through a temporary and a rename: nothing else is left in the directory.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator{}), 1);
}

TEST(PlotPng, OnePixelAndBlend) {
  Image image(1, 1, Rgb{0, 0, 0});
  image.blend(0, 0, Rgb{200, 100, 50}, 0.5f);
  EXPECT_EQ(image.at(0, 0), (Rgb{100, 50, 25}));
  image.blend(5, 5, Rgb{255, 255, 255}, 1.0f);  // outside: ignored
  const DecodedPng png = decode_png(encode_png(image));
  EXPECT_EQ(png.rgb, (std::vector<uint8_t>{100, 50, 25}));
}

TEST(PlotPng, RejectsBadImagesAndPaths) {
  EXPECT_THROW(Image(0, 10), Error);
  EXPECT_THROW(Image(10, -1), Error);
  EXPECT_THROW(Image(Image::kMaxSide + 1, 1), Error);
  EXPECT_THROW(encode_png(Image()), Error);
  Image image(4, 4);
  image.pixels().pop_back();
  EXPECT_THROW(encode_png(image), Error);
  EXPECT_THROW(write_png("/nonexistent-dir/x.png", Image(2, 2)), Error);
}

// ---- Metrics ---------------------------------------------------------------------------

TEST(PlotMetrics, ReadsRunDirectoryAndFile) {
  TempDir dir;
  const std::string file = dir.write("run1/metrics.jsonl",
                                     "{\"step\": 10, \"loss\": 3.21, \"lr\": 0.0003, \"tokens_per_s\": 5123.4}\n"
                                     "\n"
                                     "{\"step\": 20, \"loss\": 3.0, \"val_loss\": 3.1, \"extra\": \"ignored\"}\r\n"
                                     "{\"step\": 30, \"loss\": null}\n");
  for (const std::string& path : {(dir.path / "run1").string(), file}) {
    const std::vector<MetricPoint> points = read_metrics(path);
    ASSERT_EQ(points.size(), 3u);
    EXPECT_EQ(points[0].step, 10);
    EXPECT_DOUBLE_EQ(*points[0].loss, 3.21);
    EXPECT_DOUBLE_EQ(*points[0].lr, 0.0003);
    EXPECT_DOUBLE_EQ(*points[0].tokens_per_s, 5123.4);
    EXPECT_FALSE(points[0].val_loss.has_value());
    EXPECT_DOUBLE_EQ(*points[1].val_loss, 3.1);
    EXPECT_FALSE(points[1].lr.has_value());
    EXPECT_FALSE(points[2].loss.has_value());
  }
  EXPECT_EQ(run_name((dir.path / "run1").string()), "run1");
  EXPECT_EQ(run_name((dir.path / "run1").string() + "/"), "run1");
  EXPECT_EQ(run_name(file), "run1");
  EXPECT_EQ(run_name("some/where/baseline.jsonl"), "baseline");
}

TEST(PlotMetrics, ResumeRewindsHistory) {
  TempDir dir;
  // Ran to step 4, resumed from the step-2 checkpoint, ran to step 3; a late evaluation of
  // step 2 then arrives on its own line.
  dir.write("r/metrics.jsonl",
            "{\"step\": 1, \"loss\": 5}\n{\"step\": 2, \"loss\": 4, \"val_loss\": 4.5}\n{\"step\": 3, \"loss\": 3}\n"
            "{\"step\": 4, \"loss\": 2}\n"
            "{\"step\": 3, \"loss\": 3.5}\n"
            "{\"step\": 2, \"val_loss\": 4.25}\n");
  const std::vector<MetricPoint> points = read_metrics((dir.path / "r").string());
  ASSERT_EQ(points.size(), 3u);
  EXPECT_EQ(points[0].step, 1);
  EXPECT_EQ(points[1].step, 2);
  EXPECT_DOUBLE_EQ(*points[1].loss, 4);
  EXPECT_DOUBLE_EQ(*points[1].val_loss, 4.25);
  EXPECT_EQ(points[2].step, 3);
  EXPECT_DOUBLE_EQ(*points[2].loss, 3.5);  // the resumed run's value, and step 4 is gone

  // The same step logged twice in a row: the later line wins.
  dir.write("d/metrics.jsonl", "{\"step\": 7, \"loss\": 1}\n{\"step\": 7, \"loss\": 0.5}\n");
  const std::vector<MetricPoint> twice = read_metrics((dir.path / "d").string());
  ASSERT_EQ(twice.size(), 1u);
  EXPECT_DOUBLE_EQ(*twice[0].loss, 0.5);
}

TEST(PlotMetrics, MalformedLinesNameFileAndLine) {
  TempDir dir;
  const std::string good = "{\"step\": 1, \"loss\": 2.0}\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"step\": 2, \"loss\": 1.9\n", "not valid JSON"},
      {"[1, 2]\n", "expected a JSON object"},
      {"{\"loss\": 1.9}\n", "no \"step\""},
      {"{\"step\": \"2\", \"loss\": 1.9}\n", "\"step\" must be a non-negative integer"},
      {"{\"step\": 2.5, \"loss\": 1.9}\n", "\"step\" must be a non-negative integer"},
      {"{\"step\": -1, \"loss\": 1.9}\n", "\"step\" must be a non-negative integer"},
      {"{\"step\": 2, \"loss\": \"1.9\"}\n", "\"loss\" must be a number"},
      {"{\"step\": 2, \"loss\": 1.9, \"val_loss\": [1]}\n", "\"val_loss\" must be a number"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string file = dir.write("bad" + std::to_string(i) + "/metrics.jsonl", good + good + cases[i].first + good);
    try {
      read_metrics(file);
      ADD_FAILURE() << "accepted line: " << cases[i].first;
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(file + " line 3"), std::string::npos) << message;
      EXPECT_NE(message.find(cases[i].second), std::string::npos) << message;
    }
  }
}

TEST(PlotMetrics, RejectsRunsWithoutLossAndMissingPaths) {
  TempDir dir;
  EXPECT_THROW(read_metrics(dir.write("empty/metrics.jsonl", "")), Error);
  EXPECT_THROW(read_metrics(dir.write("val/metrics.jsonl", "{\"step\": 1, \"val_loss\": 2}\n")), Error);
  EXPECT_THROW(read_metrics((dir.path / "missing").string()), Error);
  fs::create_directories(dir.path / "no_metrics");
  EXPECT_THROW(read_metrics((dir.path / "no_metrics").string()), Error);
  try {
    read_metrics(dir.write("val2/metrics.jsonl", "{\"step\": 1, \"lr\": 2}\n"));
    ADD_FAILURE() << "accepted a run without loss";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no training loss"), std::string::npos) << e.what();
  }
}

TEST(PlotMetrics, UnterminatedLastLineIsStillBeingWritten) {
  TempDir dir;
  const std::string file = dir.write("live/metrics.jsonl", "{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"lo");
  EXPECT_EQ(read_metrics(file).size(), 1u);
  // Complete but unterminated: still read.
  const std::string whole = dir.write("live2/metrics.jsonl", "{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": 1}");
  EXPECT_EQ(read_metrics(whole).size(), 2u);
}

// ---- Ticks, smoothing, font -------------------------------------------------------------

TEST(PlotTicks, NiceSteps) {
  EXPECT_DOUBLE_EQ(nice_step(1.0, 5), 0.2);
  EXPECT_DOUBLE_EQ(nice_step(10000, 4), 2000);
  EXPECT_DOUBLE_EQ(nice_step(1.74, 5), 0.5);
  EXPECT_DOUBLE_EQ(nice_step(6, 1), 5);
  EXPECT_DOUBLE_EQ(nice_step(7, 1), 10);
  EXPECT_DOUBLE_EQ(nice_step(0.009, 1), 0.01);
  EXPECT_THROW(nice_step(0, 5), Error);
  EXPECT_THROW(nice_ticks(2, 1, 5), Error);

  expect_ticks(nice_ticks(0, 1, 5), {0, 0.2, 0.4, 0.6, 0.8, 1});
  expect_ticks(nice_ticks(2.13, 3.87, 5), {2.5, 3, 3.5});
  expect_ticks(nice_ticks(-15, 32, 5), {-10, 0, 10, 20, 30});
  for (double t : nice_ticks(0.1, 0.7, 6)) {  // every tick is a whole multiple of the step
    const double k = t / 0.1;
    EXPECT_NEAR(k, std::round(k), 1e-9);
  }
}

TEST(PlotTicks, LogTicks) {
  EXPECT_EQ(log_ticks(0.5, 2000, 6), (std::vector<double>{1, 10, 100, 1000}));
  expect_ticks(log_ticks(0.15, 12, 6), {0.2, 0.5, 1, 2, 5, 10});
  expect_ticks(log_ticks(1.5, 12, 6), {2, 3, 4, 5, 6, 7, 8, 9, 10});  // 2, 5, 10 alone is sparse
  expect_ticks(log_ticks(2.2, 4.5, 6), {2.5, 3, 3.5, 4, 4.5});  // under a decade: linear ticks
  expect_ticks(log_ticks(1e-12, 1e12, 6), {1e-12, 1e-9, 1e-6, 1e-3, 1, 1e3, 1e6, 1e9, 1e12});  // every third decade
  EXPECT_THROW(log_ticks(0, 1, 5), Error);
}

TEST(PlotTicks, Labels) {
  EXPECT_EQ(format_tick(0.5, 0.25), "0.50");
  EXPECT_EQ(format_tick(3, 0.5), "3.0");
  EXPECT_EQ(format_tick(2000, 500), "2000");
  EXPECT_EQ(format_tick(20000, 5000), "20k");
  EXPECT_EQ(format_tick(12500, 2500), "12.5k");
  EXPECT_EQ(format_tick(3e6, 1e6), "3M");
  EXPECT_EQ(format_tick(2e-5, 1e-5), "2e-5");
  EXPECT_EQ(format_tick(1e-17, 0.1), "0");
  EXPECT_EQ(format_tick(-0.4, 0.2), "-0.4");
}

TEST(PlotTicks, EmaSmoothing) {
  EXPECT_EQ(ema_smooth({3, 1, 2}, 0.0), (std::vector<double>{3, 1, 2}));
  const std::vector<double> s = ema_smooth({4, 4, 4, 4}, 0.9);  // debiased: a constant stays put
  for (double v : s) EXPECT_NEAR(v, 4, 1e-12);
  const std::vector<double> t = ema_smooth({0, 10}, 0.5);
  EXPECT_NEAR(t[1], (0.5 * 0.5 * 0 + 0.5 * 10) / (1 - 0.25), 1e-12);
  EXPECT_THROW(ema_smooth({1}, 1.0), Error);
}

TEST(PlotFont, EveryPrintableCharacterHasInk) {
  for (int c = 33; c <= 126; ++c) {
    int ink = 0;
    for (uint8_t row : font::glyph(char(c))) ink += __builtin_popcount(row);
    EXPECT_GT(ink, 0) << "glyph '" << char(c) << "' is blank";
  }
  std::set<font::Glyph> distinct;
  for (int c = 32; c <= 126; ++c) distinct.insert(font::glyph(char(c)));
  EXPECT_EQ(distinct.size(), 95u) << "two characters share a glyph";
  EXPECT_EQ(font::glyph('\x01'), font::glyph('\x7f'));  // the fallback box
}

// ---- The chart -------------------------------------------------------------------------

TEST(PlotChart, TwoRunsBothColoursInTheFile) {
  TempDir dir;
  dir.write("runs/alpha/metrics.jsonl", synthetic_run(600, 8.0, 2.5, 0.3, 100, 1));
  dir.write("runs/beta/metrics.jsonl", synthetic_run(400, 7.0, 3.0, 0.3, 50, 2));
  const std::string out = (dir.path / "loss.png").string();
  PlotOptions options;
  options.width = 640, options.height = 400, options.smoothing = 0.8;
  plot_runs({(dir.path / "runs/alpha").string(), (dir.path / "runs/beta").string()}, out, options);
  const DecodedPng png = decode_png(read_file(out));
  ASSERT_EQ(png.width, 640);
  ASSERT_EQ(png.height, 400);
  Image decoded(640, 400);
  decoded.pixels() = png.rgb;
  EXPECT_TRUE(contains_colour(decoded, run_colour(0)));
  EXPECT_TRUE(contains_colour(decoded, run_colour(1)));
  EXPECT_FALSE(contains_colour(decoded, run_colour(2))) << "a third run's colour in a two-run plot";
  EXPECT_NE(run_colour(0), run_colour(1));
  EXPECT_EQ(run_colour(0), run_colour(10));
}

TEST(PlotChart, CurvesGoWhereTheDataSays) {
  // One falling line: its colour must appear in the upper left and lower right quarters of
  // the plot and not in the upper right (where a rising line would be).
  std::vector<MetricPoint> points;
  for (int step = 0; step <= 100; ++step) points.push_back({.step = step, .loss = 10.0 - 0.09 * step});
  PlotOptions options;
  options.title = "";
  const Image image = plot_loss_curves({{"down", points}}, options);
  const Rgb colour = run_colour(0);
  auto count = [&](int x0, int y0, int x1, int y1) {
    int n = 0;
    for (int y = y0; y < y1; ++y)
      for (int x = x0; x < x1; ++x) n += image.at(x, y) == colour;
    return n;
  };
  const int w = image.width(), h = image.height();
  EXPECT_GT(count(w / 10, h / 10, w / 3, h / 3), 0);
  EXPECT_GT(count(2 * w / 3, 2 * h / 3, 9 * w / 10, 9 * h / 10), 0);
  EXPECT_EQ(count(w / 2, h / 6, 7 * w / 10, h / 3), 0);
}

TEST(PlotChart, SinglePointFlatAndLogRuns) {
  PlotOptions options;
  const Image one = plot_loss_curves({{"one", {{.step = 5, .loss = 2.0}}}}, options);
  EXPECT_TRUE(contains_colour(one, run_colour(0)));
  options.log_y = true;
  std::vector<MetricPoint> wide;
  for (int step = 1; step <= 1000; ++step) wide.push_back({.step = step, .loss = 100.0 / step});
  const Image log = plot_loss_curves({{"wide", wide}, {"flat", {{.step = 1, .loss = 3}, {.step = 9, .loss = 3}}}}, options);
  EXPECT_TRUE(contains_colour(log, run_colour(1)));
}

TEST(PlotChart, RejectsBadRequests) {
  const RunSeries run{"r", {{.step = 1, .loss = 1.0}, {.step = 2, .loss = 0.0}}};
  PlotOptions options;
  EXPECT_THROW(plot_loss_curves({}, options), Error);
  EXPECT_THROW(plot_loss_curves({{"empty", {{.step = 1, .val_loss = 2.0}}}}, options), Error);
  EXPECT_THROW(plot_loss_curves({{"nan", {{.step = 1, .loss = NAN}}}}, options), Error);
  options.log_y = true;
  EXPECT_THROW(plot_loss_curves({run}, options), Error);  // a zero loss on a log axis
  options.log_y = false;
  options.smoothing = 1.0;
  EXPECT_THROW(plot_loss_curves({run}, options), Error);
  options.smoothing = 0;
  options.width = 100;
  EXPECT_THROW(plot_loss_curves({run}, options), Error);
  EXPECT_THROW(plot_runs({}, "x.png", PlotOptions{}), Error);
}

// An independent decoder, when the machine has one (Pillow); skipped otherwise.
TEST(PlotPng, PillowOpensIt) {
  if (std::system("python3 -c 'import PIL' >/dev/null 2>&1") != 0) GTEST_SKIP() << "python3 with PIL not available";
  TempDir dir;
  Image image(23, 9, Rgb{255, 255, 255});
  image.set(4, 7, Rgb{1, 2, 3});
  const std::string path = (dir.path / "pil.png").string();
  write_png(path, image);
  const std::string script = "from PIL import Image; im = Image.open('" + path +
                             "'); im.load(); assert im.size == (23, 9), im.size; "
                             "assert im.convert('RGB').getpixel((4, 7)) == (1, 2, 3)";
  EXPECT_EQ(std::system(("python3 -c \"" + script + "\"").c_str()), 0);
}
