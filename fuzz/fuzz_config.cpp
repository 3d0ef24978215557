// libFuzzer target: the run-config parser (YAML text -> JSON -> RunConfig, and --set
// overrides). Any input may be rejected with tessera::Error; anything else escaping (another
// exception type, a crash, a sanitizer report) is a finding.
#include <cstdint>
#include <string>

#include "tessera/core/error.h"
#include "tessera/train/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  // The first line, when it holds '=', is also tried as a --set override.
  const std::string first_line = text.substr(0, text.find('\n'));
  try {
    nlohmann::json j = tessera::train::yaml_text_to_json(text, "fuzz input");
    if (!j.is_object()) j = nlohmann::json::object();
    if (first_line.find('=') != std::string::npos) {
      try {
        tessera::train::apply_override(j, first_line);
      } catch (const tessera::Error&) {
      }
    }
    const tessera::train::RunConfig c = tessera::train::RunConfig::from_json(j);
    // What a checkpoint records must parse back to the same config.
    const nlohmann::json again = c.to_json();
    if (tessera::train::RunConfig::from_json(again).to_json() != again) __builtin_trap();
  } catch (const tessera::Error&) {
  }
  return 0;
}
