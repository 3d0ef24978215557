#include "tessera/core/error.h"

#include <cstring>

namespace tessera::detail {

[[noreturn]] void throw_error(const char* file, int line, const std::string& message) {
  // Keep only the path below src/ or include/ so messages stay short and stable.
  const char* shown = file;
  for (const char* marker : {"/src/", "/include/"}) {
    if (const char* p = std::strstr(file, marker)) shown = p + 1;
  }
  throw Error(concat(message, " [", shown, ":", line, "]"));
}

}  // namespace tessera::detail
