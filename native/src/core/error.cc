#include "uccl_moe/error.hpp"

#include <cstdio>
#include <cstring>
#include <vector>

namespace uccl_moe {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidUsage: return "InvalidUsage";
    case ErrorCode::kSystem: return "System";
    case ErrorCode::kCuda: return "Cuda";
    case ErrorCode::kTransport: return "Transport";
    case ErrorCode::kTimeout: return "Timeout";
    case ErrorCode::kInternal: return "Internal";
  }
  return "Unknown";
}

namespace detail {

std::string vformat(const char* fmt, va_list args) {
  va_list copy;
  va_copy(copy, args);
  int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  if (n < 0) return fmt;
  std::vector<char> buf(static_cast<size_t>(n) + 1);
  std::vsnprintf(buf.data(), buf.size(), fmt, args);
  return std::string(buf.data(), static_cast<size_t>(n));
}

std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::string s = vformat(fmt, args);
  va_end(args);
  return s;
}

void throw_error(ErrorCode code, const char* file, int line, const std::string& what) {
  const char* base = std::strrchr(file, '/');
  throw Error(code, what + " (" + (base ? base + 1 : file) + ":" + std::to_string(line) + ")");
}

void throw_errno(int errnum, const char* file, int line, const std::string& what) {
  throw_error(ErrorCode::kSystem, file, line, what + ": " + std::strerror(errnum) + " (errno " + std::to_string(errnum) + ")");
}

}  // namespace detail
}  // namespace uccl_moe
