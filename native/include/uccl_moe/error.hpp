// Error types and check macros. Every error carries a code, a message and the file:line it came from.
// The Python binding maps codes to uccl_moe.errors.* (see native/src/bindings/module.cc).
#pragma once

#include <cstdarg>
#include <stdexcept>
#include <string>

namespace uccl_moe {

enum class ErrorCode : int {
  kInvalidUsage = 1,  ///< caller passed something wrong; fix the call (Python: ValueError subclass)
  kSystem = 2,        ///< an OS call failed (errno decoded)
  kCuda = 3,          ///< a CUDA/HIP runtime call failed
  kTransport = 4,     ///< a network transport failed (completion error, QP state, ...)
  kTimeout = 5,       ///< a bounded wait expired; message holds the diagnostic record
  kInternal = 6,      ///< a broken invariant inside uccl-moe: a bug, please report it
};

const char* error_code_name(ErrorCode code);

/// Root of all uccl-moe C++ errors.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string message) : std::runtime_error(std::move(message)), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
/// printf-style formatting into std::string.
std::string vformat(const char* fmt, va_list args);
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] void throw_error(ErrorCode code, const char* file, int line, const std::string& what);
/// Like throw_error for kSystem, appending strerror(errnum).
[[noreturn]] void throw_errno(int errnum, const char* file, int line, const std::string& what);
}  // namespace detail

}  // namespace uccl_moe

/// Usage error: UCCL_ASSERT(num_experts % world == 0, "num_experts=%d world=%d", e, w).
#define UCCL_ASSERT(cond, ...)                                                                               \
  do {                                                                                                       \
    if (!(cond))                                                                                             \
      ::uccl_moe::detail::throw_error(::uccl_moe::ErrorCode::kInvalidUsage, __FILE__, __LINE__,             \
                                      std::string("check failed: " #cond ": ") +                             \
                                          ::uccl_moe::detail::format(__VA_ARGS__));                          \
  } while (0)

/// Invariant inside the library (a failure is our bug).
#define UCCL_CHECK_INTERNAL(cond, ...)                                                                       \
  do {                                                                                                       \
    if (!(cond))                                                                                             \
      ::uccl_moe::detail::throw_error(::uccl_moe::ErrorCode::kInternal, __FILE__, __LINE__,                 \
                                      std::string("internal invariant failed: " #cond ": ") +                \
                                          ::uccl_moe::detail::format(__VA_ARGS__));                          \
  } while (0)

/// Throw an error with an explicit code and printf message.
#define UCCL_THROW(code, ...) \
  ::uccl_moe::detail::throw_error(::uccl_moe::ErrorCode::code, __FILE__, __LINE__, ::uccl_moe::detail::format(__VA_ARGS__))

/// A POSIX call returning -1/errno: UCCL_CHECK_SYS(fd = open(...), "open %s", path).
#define UCCL_CHECK_SYS(expr, ...)                                                                            \
  do {                                                                                                       \
    if ((expr) < 0)                                                                                          \
      ::uccl_moe::detail::throw_errno(errno, __FILE__, __LINE__,                                             \
                                      std::string(#expr ": ") + ::uccl_moe::detail::format(__VA_ARGS__));    \
  } while (0)
