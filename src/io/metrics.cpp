// Parsing of metrics.jsonl (one JSON object per line) into one point per step, replaying
// the rewinds of resumed runs so the result is the history the final run actually followed.
#include "tessera/io/metrics.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <string_view>

#include "tessera/core/error.h"
#include "tessera/io/atomic_file.h"

namespace tessera::io {

namespace fs = std::filesystem;

namespace {

std::string metrics_path(const std::string& run_dir_or_file) {
  TESSERA_CHECK(!run_dir_or_file.empty(), "read_metrics: empty run path");
  std::error_code ec;
  if (fs::is_directory(run_dir_or_file, ec)) {
    const std::string file = (fs::path(run_dir_or_file) / "metrics.jsonl").string();
    TESSERA_CHECK(is_regular_file(file), "read_metrics: run directory ", run_dir_or_file,
                  " has no metrics.jsonl (expected ", file, ")");
    return file;
  }
  TESSERA_CHECK(fs::exists(run_dir_or_file, ec), "read_metrics: ", run_dir_or_file,
                " does not exist (give a run directory or its metrics.jsonl)");
  return run_dir_or_file;
}

// The value of an optional numeric field: absent or null gives no value.
std::optional<double> number_field(const nlohmann::json& line, const char* key, const std::string& where) {
  const auto it = line.find(key);
  if (it == line.end() || it->is_null()) return std::nullopt;
  TESSERA_CHECK(it->is_number(), "read_metrics: ", where, ": \"", key, "\" must be a number or null, got ",
                it->type_name(), " ", it->dump());
  return it->get<double>();
}

void merge_into(MetricPoint& point, const MetricPoint& line) {
  if (line.loss) point.loss = line.loss;
  if (line.val_loss) point.val_loss = line.val_loss;
  if (line.lr) point.lr = line.lr;
  if (line.tokens_per_s) point.tokens_per_s = line.tokens_per_s;
}

void record(std::vector<MetricPoint>& points, const MetricPoint& line) {
  if (points.empty() || line.step > points.back().step) {
    points.push_back(line);
    return;
  }
  auto at = std::lower_bound(points.begin(), points.end(), line.step,
                             [](const MetricPoint& p, int64_t step) { return p.step < step; });
  const bool same_step = at != points.end() && at->step == line.step;
  // Only a training step marks a resume; an evaluation logged late for an earlier step
  // (no "loss") joins that step without discarding what came after it.
  if (line.loss) {
    points.erase(same_step ? at + 1 : at, points.end());
    if (same_step)
      merge_into(points.back(), line);
    else
      points.push_back(line);
  } else if (same_step) {
    merge_into(*at, line);
  } else {
    points.insert(at, line);
  }
}

}  // namespace

std::vector<MetricPoint> read_metrics(const std::string& run_dir_or_file) {
  const std::string path = metrics_path(run_dir_or_file);
  const std::string text = read_file(path);
  std::vector<MetricPoint> points;
  size_t begin = 0;
  for (int64_t line_number = 1; begin < text.size(); ++line_number) {
    size_t end = text.find('\n', begin);
    const bool terminated = end != std::string::npos;
    if (!terminated) end = text.size();
    std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;

    const std::string where = path + " line " + std::to_string(line_number);
    nlohmann::json object;
    try {
      object = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      if (!terminated) break;  // the live run has not finished writing this line yet
      // nlohmann counts lines within the one line it was given: keep only the column.
      std::string reason = e.what();
      if (const size_t at = reason.find("at line 1, column "); at != std::string::npos) reason.erase(at + 3, 8);
      TESSERA_FAIL("read_metrics: ", where, ": not valid JSON (", reason, ")");
    }
    TESSERA_CHECK(object.is_object(), "read_metrics: ", where, ": expected a JSON object, got ", object.type_name());
    const auto step = object.find("step");
    TESSERA_CHECK(step != object.end(), "read_metrics: ", where, ": no \"step\" field");
    TESSERA_CHECK(step->is_number_integer() && (step->is_number_unsigned() || step->get<int64_t>() >= 0),
                  "read_metrics: ", where, ": \"step\" must be a non-negative integer, got ", step->dump());
    TESSERA_CHECK(!step->is_number_unsigned() || step->get<uint64_t>() <= uint64_t(INT64_MAX), "read_metrics: ",
                  where, ": \"step\" ", step->dump(), " is too large");
    MetricPoint point;
    point.step = step->get<int64_t>();
    point.loss = number_field(object, "loss", where);
    point.val_loss = number_field(object, "val_loss", where);
    point.lr = number_field(object, "lr", where);
    point.tokens_per_s = number_field(object, "tokens_per_s", where);
    record(points, point);
  }
  const bool has_loss = std::any_of(points.begin(), points.end(), [](const MetricPoint& p) { return p.loss.has_value(); });
  TESSERA_CHECK(has_loss, "read_metrics: ", path, " has no training loss values (",
                points.empty() ? std::string("no metric lines") : std::to_string(points.size()) + " steps without \"loss\"",
                ")");
  return points;
}

std::string run_name(const std::string& run_dir_or_file) {
  // Drops trailing separators ("runs/a/" -> "runs/a") without climbing past the root.
  const auto trim = [](fs::path p) {
    while (!p.empty() && !p.has_filename() && p != p.root_path()) p = p.parent_path();
    return p;
  };
  fs::path path(run_dir_or_file);
  std::error_code ec;
  if (!fs::is_directory(path, ec) && path.has_filename()) {
    if (path.filename() != "metrics.jsonl") return path.stem().string();
    path = path.parent_path();
  }
  path = trim(path);
  if (path.empty() || path.filename() == "." || path.filename() == "..")
    path = trim(fs::absolute(path.empty() ? fs::path(".") : path, ec).lexically_normal());
  const std::string name = path.filename().string();
  return name.empty() ? run_dir_or_file : name;
}

}  // namespace tessera::io
