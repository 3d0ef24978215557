// The one exception type of tessera, and the check macro every public entry point uses.
//
// Messages say what was wrong, with the shapes or dtypes involved, and where:
//   TESSERA_CHECK(a.dim() == 2, "gemm: A must be 2-D, got shape ", a.shape_string());
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
[[noreturn]] void throw_error(const char* file, int line, const std::string& message);
}  // namespace detail

}  // namespace tessera

#define TESSERA_CHECK(cond, ...)                                                        \
  do {                                                                                  \
    if (!(cond)) ::tessera::detail::throw_error(__FILE__, __LINE__, ::tessera::detail::concat(__VA_ARGS__)); \
  } while (0)

#define TESSERA_FAIL(...) ::tessera::detail::throw_error(__FILE__, __LINE__, ::tessera::detail::concat(__VA_ARGS__))
