// The loss-curve chart: layout (margins measured from the tick labels), axis mapping
// (linear or log10), anti-aliased strokes and the bitmap-font text, all on an RGB Image.
//
// Strokes are rendered as coverage masks: every pixel takes the largest coverage any
// segment of the polyline gives it, then the mask is blended once in the run's colour, so
// joints and overlapping segments do not darken.
#include "tessera/io/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <map>

#include "bitmap_font.h"
#include "tessera/core/error.h"

namespace tessera::io {

namespace {

constexpr Rgb kWhite{255, 255, 255}, kInk{40, 40, 40}, kAxis{90, 90, 90}, kGrid{232, 232, 232};

struct Rect {
  int x = 0, y = 0, w = 0, h = 0;
  int right() const { return x + w; }
  int bottom() const { return y + h; }
};

struct Point {
  double x, y;
};

// ---- Text ------------------------------------------------------------------------------

int text_width(const std::string& text, int scale) {
  return text.empty() ? 0 : (static_cast<int>(text.size()) * font::kAdvance - 1) * scale;
}

// Horizontal text whose top-left corner (top of the capitals) is (x, y).
void draw_text(Image& image, int x, int y, const std::string& text, Rgb colour, int scale) {
  for (char c : text) {
    const font::Glyph& g = font::glyph(c);
    for (int row = 0; row < font::kGlyphHeight; ++row)
      for (int col = 0; col < font::kGlyphWidth; ++col)
        if (g[row] >> (font::kGlyphWidth - 1 - col) & 1)
          for (int dy = 0; dy < scale; ++dy)
            for (int dx = 0; dx < scale; ++dx) {
              const int px = x + col * scale + dx, py = y + row * scale + dy;
              if (image.contains(px, py)) image.set(px, py, colour);
            }
    x += font::kAdvance * scale;
  }
}

// Text turned a quarter counter-clockwise (read bottom to top), its bounding box starting
// at (x, y): the box is kGlyphHeight * scale wide and text_width() tall.
void draw_text_vertical(Image& image, int x, int y, const std::string& text, Rgb colour, int scale) {
  const int length = text_width(text, scale);
  for (size_t i = 0; i < text.size(); ++i) {
    const font::Glyph& g = font::glyph(text[i]);
    for (int row = 0; row < font::kGlyphHeight; ++row)
      for (int col = 0; col < font::kGlyphWidth; ++col)
        if (g[row] >> (font::kGlyphWidth - 1 - col) & 1)
          for (int d1 = 0; d1 < scale; ++d1)
            for (int d2 = 0; d2 < scale; ++d2) {
              const int along = static_cast<int>(i) * font::kAdvance * scale + col * scale + d1;
              const int px = x + row * scale + d2, py = y + length - 1 - along;
              if (image.contains(px, py)) image.set(px, py, colour);
            }
  }
}

// ---- Strokes ---------------------------------------------------------------------------

class CoverageMask {
 public:
  explicit CoverageMask(Rect area) : area_(area), alpha_(static_cast<size_t>(area.w) * area.h, 0.0f) {}

  // A segment with round caps, `half_width` pixels either side of its centre line.
  void segment(Point a, Point b, double half_width) {
    const double reach = half_width + 1;
    const int x0 = std::max(area_.x, static_cast<int>(std::floor(std::min(a.x, b.x) - reach)));
    const int x1 = std::min(area_.right() - 1, static_cast<int>(std::ceil(std::max(a.x, b.x) + reach)));
    const int y0 = std::max(area_.y, static_cast<int>(std::floor(std::min(a.y, b.y) - reach)));
    const int y1 = std::min(area_.bottom() - 1, static_cast<int>(std::ceil(std::max(a.y, b.y) + reach)));
    const double dx = b.x - a.x, dy = b.y - a.y, length2 = dx * dx + dy * dy;
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) {
        const double px = x + 0.5 - a.x, py = y + 0.5 - a.y;
        const double t = length2 > 0 ? std::clamp((px * dx + py * dy) / length2, 0.0, 1.0) : 0.0;
        const double ex = px - t * dx, ey = py - t * dy;
        cover(x, y, half_width + 0.5 - std::sqrt(ex * ex + ey * ey));
      }
  }

  void disc(Point c, double radius) { segment(c, c, radius); }

  void polyline(const std::vector<Point>& points, double half_width) {
    if (points.size() == 1) disc(points[0], half_width + 1.5);  // a lone point stays visible
    for (size_t i = 1; i < points.size(); ++i) segment(points[i - 1], points[i], half_width);
  }

  void paint(Image& image, Rgb colour, float opacity) const {
    for (int y = 0; y < area_.h; ++y)
      for (int x = 0; x < area_.w; ++x) {
        const float a = alpha_[static_cast<size_t>(y) * area_.w + x];
        if (a > 0) image.blend(area_.x + x, area_.y + y, colour, a * opacity);
      }
  }

  // Pixels of `box` with any coverage: how much a legend there would hide.
  int64_t ink_in(Rect box) const {
    int64_t n = 0;
    for (int y = std::max(box.y, area_.y); y < std::min(box.bottom(), area_.bottom()); ++y)
      for (int x = std::max(box.x, area_.x); x < std::min(box.right(), area_.right()); ++x)
        n += alpha_[static_cast<size_t>(y - area_.y) * area_.w + (x - area_.x)] > 0;
    return n;
  }

  void add(const CoverageMask& other) {
    for (size_t i = 0; i < alpha_.size(); ++i) alpha_[i] = std::max(alpha_[i], other.alpha_[i]);
  }

 private:
  void cover(int x, int y, double coverage) {
    if (coverage <= 0) return;
    float& a = alpha_[static_cast<size_t>(y - area_.y) * area_.w + (x - area_.x)];
    a = std::max(a, static_cast<float>(std::min(coverage, 1.0)));
  }

  Rect area_;
  std::vector<float> alpha_;
};

void fill_rect(Image& image, Rect r, Rgb colour, float opacity = 1.0f) {
  for (int y = r.y; y < r.bottom(); ++y)
    for (int x = r.x; x < r.right(); ++x) image.blend(x, y, colour, opacity);
}

void outline_rect(Image& image, Rect r, Rgb colour) {
  fill_rect(image, {r.x, r.y, r.w, 1}, colour);
  fill_rect(image, {r.x, r.bottom() - 1, r.w, 1}, colour);
  fill_rect(image, {r.x, r.y, 1, r.h}, colour);
  fill_rect(image, {r.right() - 1, r.y, 1, r.h}, colour);
}

// Keeps the first, lowest, highest and last point of each pixel column, in order, when a
// series has many more points than the plot has columns: the drawn envelope is unchanged.
std::vector<Point> thin_out(const std::vector<Point>& points, int columns) {
  if (points.size() <= static_cast<size_t>(4 * columns)) return points;
  std::vector<Point> out;
  size_t begin = 0;
  while (begin < points.size()) {
    const int column = static_cast<int>(std::floor(points[begin].x));
    size_t end = begin, low = begin, high = begin;
    while (end < points.size() && static_cast<int>(std::floor(points[end].x)) == column) {
      if (points[end].y < points[low].y) low = end;
      if (points[end].y > points[high].y) high = end;
      ++end;
    }
    size_t keep[4] = {begin, std::min(low, high), std::max(low, high), end - 1};
    for (int k = 0; k < 4; ++k)
      if (k == 0 || keep[k] != keep[k - 1]) out.push_back(points[keep[k]]);
    begin = end;
  }
  return out;
}

// ---- Axes ------------------------------------------------------------------------------

struct Axis {
  double lo = 0, hi = 1;  // in axis units (log10 of the value for a log axis)
  bool log = false;
  std::vector<double> ticks;  // values
  std::vector<std::string> labels;
  double map(double value) const { return ((log ? std::log10(value) : value) - lo) / (hi - lo); }
};

// The multiples of `step` within [lo, hi]. Multiples k * step (never a running sum) keep
// 0.3 from becoming 0.30000000000000004.
std::vector<double> multiples_within(double lo, double hi, double step) {
  std::vector<double> ticks;
  for (double k = std::ceil(lo / step - 1e-9); k * step <= hi + step * 1e-9; ++k) ticks.push_back(k * step);
  return ticks;
}

// `integer`: the values are steps, so ticks fall on whole numbers and a single step gets
// one step of room either side.
Axis make_axis(double min_value, double max_value, bool log, bool integer, double pad_fraction, int target) {
  Axis axis;
  axis.log = log;
  double lo = log ? std::log10(min_value) : min_value, hi = log ? std::log10(max_value) : max_value;
  if (integer && hi - lo < 2) {
    lo -= 1, hi += 1;
  } else if (hi - lo < 1e-12 * std::max(1.0, std::abs(hi))) {  // a flat series: give it room
    const double room = log ? 0.05 : std::max(std::abs(hi) * 0.05, 1e-3);
    lo -= room, hi += room;
  }
  const double pad = (hi - lo) * pad_fraction;
  axis.lo = lo - pad, axis.hi = hi + pad;
  if (log) {
    axis.ticks = log_ticks(std::pow(10.0, axis.lo), std::pow(10.0, axis.hi), target);
    // 1/2/5 x 10^k ticks are labelled each with its own digits; linear fallbacks share a step.
    const double linear_step = nice_step(std::pow(10.0, axis.hi) - std::pow(10.0, axis.lo), target);
    const bool linear = std::any_of(axis.ticks.begin(), axis.ticks.end(), [](double v) {
      const double mantissa = v / std::pow(10.0, std::floor(std::log10(v) + 1e-9));
      return std::abs(mantissa - std::round(mantissa)) > 1e-6;
    });
    for (double v : axis.ticks) axis.labels.push_back(format_tick(v, linear ? linear_step : v));
  } else {
    const double step = std::max(integer ? 1.0 : 0.0, nice_step(axis.hi - axis.lo, target));
    axis.ticks = multiples_within(axis.lo, axis.hi, step);
    for (double v : axis.ticks) axis.labels.push_back(format_tick(v, step));
  }
  return axis;
}

// ---- The chart -------------------------------------------------------------------------

struct SeriesPixels {
  std::vector<Point> raw, train, val;
};

void check_options(const std::vector<RunSeries>& runs, const PlotOptions& o) {
  TESSERA_CHECK(!runs.empty(), "plot_loss_curves: no runs to plot");
  TESSERA_CHECK(o.width >= 320 && o.height >= 240 && o.width <= Image::kMaxSide && o.height <= Image::kMaxSide,
                "plot_loss_curves: image size ", o.width, "x", o.height, " is outside 320x240 .. ", Image::kMaxSide,
                "x", Image::kMaxSide);
  TESSERA_CHECK(o.smoothing >= 0 && o.smoothing < 1, "plot_loss_curves: smoothing must be in [0, 1), got ",
                o.smoothing);
  for (const RunSeries& run : runs) {
    bool has_loss = false;
    for (const MetricPoint& p : run.points) {
      has_loss |= p.loss.has_value();
      for (const std::optional<double>& v : {p.loss, p.val_loss}) {
        if (!v) continue;
        TESSERA_CHECK(std::isfinite(*v), "plot_loss_curves: run '", run.name, "' has a non-finite loss ", *v,
                      " at step ", p.step);
        TESSERA_CHECK(!o.log_y || *v > 0, "plot_loss_curves: a log-scale axis needs positive losses; run '",
                      run.name, "' has ", *v, " at step ", p.step);
      }
    }
    TESSERA_CHECK(has_loss, "plot_loss_curves: run '", run.name, "' has no training loss values");
  }
}

}  // namespace

Image plot_loss_curves(const std::vector<RunSeries>& runs, const PlotOptions& o) {
  check_options(runs, o);
  const int s = std::max(1, std::min(o.width, o.height * 5 / 3) / 1100 + 1);  // text scale
  const int tick_length = 5 * s, gap = 6 * s, text_h = font::kCapHeight * s;

  double min_step = INFINITY, max_step = -INFINITY, min_loss = INFINITY, max_loss = -INFINITY;
  for (const RunSeries& run : runs)
    for (const MetricPoint& p : run.points)
      for (const std::optional<double>& v : {p.loss, p.val_loss})
        if (v) {
          min_step = std::min(min_step, double(p.step)), max_step = std::max(max_step, double(p.step));
          min_loss = std::min(min_loss, *v), max_loss = std::max(max_loss, *v);
        }

  // Margins follow from the label sizes, which follow from the ticks of a first guess at the plot size.
  const int title_scale = 2 * s;
  const int top = gap * 2 + font::kCapHeight * title_scale + gap;
  const int bottom = tick_length + gap + text_h + gap + text_h + gap * 2;
  const Axis y_axis = make_axis(min_loss, max_loss, o.log_y, false, 0.05, std::max(3, (o.height - top - bottom) / (40 * s + 20)));
  int widest = 0;
  for (const std::string& label : y_axis.labels) widest = std::max(widest, text_width(label, s));
  const int left = gap * 2 + text_h + gap * 2 + widest + gap + tick_length;
  const int right = 6 * gap;
  const Rect plot{left, top, o.width - left - right, o.height - top - bottom};
  TESSERA_CHECK(plot.w >= 50 && plot.h >= 50, "plot_loss_curves: a ", o.width, "x", o.height,
                " image leaves no room for the plot");
  const Axis x_axis = make_axis(min_step, max_step, false, true, 0.015, std::max(2, plot.w / (70 * s + 40)));

  const auto to_pixel = [&](double step, double loss) {
    return Point{plot.x + x_axis.map(step) * plot.w, plot.bottom() - y_axis.map(loss) * plot.h};
  };

  Image image(o.width, o.height, kWhite);
  for (double v : y_axis.ticks) {
    const int y = static_cast<int>(std::lround(to_pixel(min_step, v).y - 0.5));
    fill_rect(image, {plot.x, y, plot.w, 1}, kGrid);
  }
  for (double v : x_axis.ticks) {
    const int x = static_cast<int>(std::lround(to_pixel(v, min_loss).x - 0.5));
    fill_rect(image, {x, plot.y, 1, plot.h}, kGrid);
  }

  // Training curves first and validation curves over them all, so a dense training band
  // never hides a validation line; the union of the ink decides where the legend goes.
  CoverageMask all_ink(plot);
  std::vector<std::vector<Point>> val_points(runs.size());
  for (size_t r = 0; r < runs.size(); ++r) {
    std::vector<double> losses;
    std::vector<int64_t> steps;
    for (const MetricPoint& p : runs[r].points) {
      if (p.loss) losses.push_back(*p.loss), steps.push_back(p.step);
      if (p.val_loss) val_points[r].push_back(to_pixel(double(p.step), *p.val_loss));
    }
    const std::vector<double> smooth = ema_smooth(losses, o.smoothing);
    std::vector<Point> raw, train;
    for (size_t i = 0; i < losses.size(); ++i) {
      raw.push_back(to_pixel(double(steps[i]), losses[i]));
      train.push_back(to_pixel(double(steps[i]), smooth[i]));
    }
    if (o.smoothing > 0) {
      CoverageMask faint(plot);
      faint.polyline(thin_out(raw, plot.w), 0.6 * s);
      faint.paint(image, run_colour(r), 0.25f);
      all_ink.add(faint);
    }
    CoverageMask line(plot);
    line.polyline(thin_out(train, plot.w), 0.75 * s);
    line.paint(image, run_colour(r), 1.0f);
    all_ink.add(line);
  }
  for (size_t r = 0; r < runs.size(); ++r) {
    if (val_points[r].empty()) continue;
    // A white casing and white rings keep the line and markers readable over a training
    // band of the same colour.
    CoverageMask casing(plot), line(plot), halo(plot), markers(plot);
    casing.polyline(val_points[r], 2.75 * s);
    line.polyline(val_points[r], 1.5 * s);
    for (const Point& p : val_points[r]) halo.disc(p, 4.5 * s), markers.disc(p, 3.0 * s);
    casing.paint(image, kWhite, 0.8f);
    line.paint(image, run_colour(r), 1.0f);
    halo.paint(image, kWhite, 1.0f);
    markers.paint(image, run_colour(r), 1.0f);
    all_ink.add(casing), all_ink.add(halo);
  }

  // Frame, ticks and tick labels.
  outline_rect(image, {plot.x - 1, plot.y - 1, plot.w + 2, plot.h + 2}, kAxis);
  for (size_t i = 0; i < y_axis.ticks.size(); ++i) {
    const int y = static_cast<int>(std::lround(to_pixel(min_step, y_axis.ticks[i]).y - 0.5));
    fill_rect(image, {plot.x - 1 - tick_length, y, tick_length, s}, kAxis);
    const std::string& label = y_axis.labels[i];
    draw_text(image, plot.x - 1 - tick_length - gap - text_width(label, s), y - text_h / 2, label, kInk, s);
  }
  for (size_t i = 0; i < x_axis.ticks.size(); ++i) {
    const int x = static_cast<int>(std::lround(to_pixel(x_axis.ticks[i], min_loss).x - 0.5));
    fill_rect(image, {x, plot.bottom() + 1, s, tick_length}, kAxis);
    const std::string& label = x_axis.labels[i];
    draw_text(image, x - text_width(label, s) / 2, plot.bottom() + 1 + tick_length + gap, label, kInk, s);
  }

  // Title and axis labels.
  draw_text(image, plot.x + (plot.w - text_width(o.title, title_scale)) / 2, gap * 2, o.title, kInk, title_scale);
  const std::string x_label = "step", y_label = o.log_y ? "loss (log scale)" : "loss";
  draw_text(image, plot.x + (plot.w - text_width(x_label, s)) / 2, o.height - gap * 2 - text_h, x_label, kInk, s);
  draw_text_vertical(image, gap * 2, plot.y + (plot.h - text_width(y_label, s)) / 2, y_label, kInk, s);

  // Legend: one row per curve, in the plot corner where it hides the least.
  struct Entry {
    std::string text;
    size_t run;
    bool val;
  };
  std::vector<Entry> entries;
  for (size_t r = 0; r < runs.size(); ++r) {
    entries.push_back({runs[r].name + " train", r, false});
    if (!val_points[r].empty()) entries.push_back({runs[r].name + " val", r, true});
  }
  const int swatch = 26 * s, row_h = font::kLineHeight * s + 4 * s, pad = 6 * s;
  int text_w = 0;
  for (const Entry& e : entries) text_w = std::max(text_w, text_width(e.text, s));
  const int box_w = pad + swatch + gap + text_w + pad, box_h = pad + static_cast<int>(entries.size()) * row_h + pad - 4 * s;
  const int inset = 8 * s;
  const Rect corners[4] = {{plot.right() - inset - box_w, plot.y + inset, box_w, box_h},
                           {plot.x + inset, plot.y + inset, box_w, box_h},
                           {plot.right() - inset - box_w, plot.bottom() - inset - box_h, box_w, box_h},
                           {plot.x + inset, plot.bottom() - inset - box_h, box_w, box_h}};
  Rect box = corners[0];
  int64_t least = all_ink.ink_in(box);
  for (const Rect& c : corners)
    if (const int64_t ink = all_ink.ink_in(c); ink < least) least = ink, box = c;
  fill_rect(image, box, kWhite, 0.9f);
  outline_rect(image, box, Rgb{190, 190, 190});
  for (size_t i = 0; i < entries.size(); ++i) {
    const int top_y = box.y + pad + static_cast<int>(i) * row_h;
    const double mid = top_y + text_h / 2.0;
    const Point a{box.x + pad + 0.0, mid}, b{box.x + pad + double(swatch), mid};
    CoverageMask line({box.x, box.y, box.w, box.h});
    line.segment(a, b, (entries[i].val ? 1.5 : 0.75) * s);
    line.paint(image, run_colour(entries[i].run), 1.0f);
    if (entries[i].val) {
      CoverageMask halo({box.x, box.y, box.w, box.h}), marker({box.x, box.y, box.w, box.h});
      const Point centre{(a.x + b.x) / 2, mid};
      halo.disc(centre, 4.5 * s), marker.disc(centre, 3.0 * s);
      halo.paint(image, kWhite, 1.0f);
      marker.paint(image, run_colour(entries[i].run), 1.0f);
    }
    draw_text(image, box.x + pad + swatch + gap, top_y, entries[i].text, kInk, s);
  }
  return image;
}

void plot_runs(const std::vector<std::string>& run_paths, const std::string& out_path, const PlotOptions& options) {
  TESSERA_CHECK(!run_paths.empty(), "plot_runs: no run directories given");
  TESSERA_CHECK(!out_path.empty(), "plot_runs: empty output path");
  std::vector<RunSeries> runs;
  std::map<std::string, int> uses;
  for (const std::string& path : run_paths) {
    runs.push_back({run_name(path), read_metrics(path)});
    ++uses[runs.back().name];
  }
  for (size_t i = 0; i < runs.size(); ++i)
    if (uses[runs[i].name] > 1) {
      const std::string parent = run_name(std::filesystem::path(run_paths[i]).parent_path().string());
      runs[i].name = parent + "/" + runs[i].name;
    }
  write_png(out_path, plot_loss_curves(runs, options));
}

Rgb run_colour(size_t index) {
  // Tableau 10: distinct hues that stay apart for common colour-vision deficiencies.
  static constexpr Rgb kPalette[10] = {{31, 119, 180}, {255, 127, 14},  {44, 160, 44},  {214, 39, 40},
                                       {148, 103, 189}, {140, 86, 75},  {227, 119, 194}, {127, 127, 127},
                                       {188, 189, 34},  {23, 190, 207}};
  return kPalette[index % 10];
}

std::vector<double> ema_smooth(const std::vector<double>& values, double weight) {
  TESSERA_CHECK(weight >= 0 && weight < 1, "ema_smooth: weight must be in [0, 1), got ", weight);
  std::vector<double> out(values.size());
  double state = 0, bias = 1;
  for (size_t i = 0; i < values.size(); ++i) {
    state = weight * state + (1 - weight) * values[i];
    bias *= weight;
    out[i] = state / (1 - bias);
  }
  return out;
}

double nice_step(double span, int target) {
  TESSERA_CHECK(span > 0 && std::isfinite(span) && target > 0, "nice_step: needs a positive finite span and target, got ",
                span, " and ", target);
  const double raw = span / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / magnitude;
  return magnitude * (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10);
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
  TESSERA_CHECK(lo < hi && std::isfinite(lo) && std::isfinite(hi), "nice_ticks: needs lo < hi, got ", lo, " and ", hi);
  return multiples_within(lo, hi, nice_step(hi - lo, target));
}

std::vector<double> log_ticks(double lo, double hi, int target) {
  TESSERA_CHECK(lo > 0 && lo < hi && std::isfinite(hi), "log_ticks: needs 0 < lo < hi, got ", lo, " and ", hi);
  const int first = static_cast<int>(std::floor(std::log10(lo))), last = static_cast<int>(std::ceil(std::log10(hi)));
  const auto within = [&](std::initializer_list<int> mantissas, int stride) {
    std::vector<double> ticks;
    for (int k = first; k <= last; ++k) {
      if (((k % stride) + stride) % stride != 0) continue;
      for (int m : mantissas) {
        const double v = m * std::pow(10.0, k);
        if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9)) ticks.push_back(v);
      }
    }
    return ticks;
  };
  if (std::vector<double> decades = within({1}, 1); decades.size() >= 3) {
    const int stride = std::max<int>(1, static_cast<int>(std::ceil(decades.size() / (1.5 * target))));
    return stride == 1 ? decades : within({1}, stride);
  }
  // 1/2/5 alone leaves a range of about a decade with three ticks; all nine digits are
  // better there, as long as they do not crowd.
  const std::vector<double> coarse = within({1, 2, 5}, 1);
  if (coarse.size() >= 4) return coarse;
  if (std::vector<double> fine = within({1, 2, 3, 4, 5, 6, 7, 8, 9}, 1); fine.size() >= 3 && fine.size() <= 12)
    return fine;
  if (coarse.size() >= 3) return coarse;
  return nice_ticks(lo, hi, target);
}

std::string format_tick(double value, double step) {
  step = std::abs(step);
  if (std::abs(value) < step * 1e-9 || value == 0) return "0";
  // The fewest decimals that write x exactly (to rounding error).
  const auto decimals_for = [](double x) {
    for (int d = 0; d < 9; ++d) {
      const double scaled = x * std::pow(10.0, d);
      if (std::abs(scaled - std::round(scaled)) < 1e-6 * std::max(1.0, std::abs(scaled))) return d;
    }
    return 9;
  };
  char buffer[64];
  if (step < 1e-4) {
    const int exponent = static_cast<int>(std::floor(std::log10(std::abs(value)) + 1e-9));
    const double mantissa = value / std::pow(10.0, exponent);
    std::snprintf(buffer, sizeof buffer, "%.*fe%d", std::min(decimals_for(mantissa), 3), mantissa, exponent);
    return buffer;
  }
  const char* suffix = "";
  if (step >= 1e6) {
    value /= 1e6, step /= 1e6, suffix = "M";
  } else if (step >= 1e3) {
    value /= 1e3, step /= 1e3, suffix = "k";
  }
  std::snprintf(buffer, sizeof buffer, "%.*f%s", decimals_for(step), value, suffix);
  return buffer;
}

}  // namespace tessera::io
