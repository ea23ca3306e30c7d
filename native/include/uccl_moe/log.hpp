// One logging system: levels x subsystems, controlled by UCCL_MOE_LOG_LEVEL and UCCL_MOE_LOG_SUBSYS.
//   UCCL_LOG(INFO, PROXY, "pinned to core %d", core);
// The level check happens before any formatting. Lines look like
//   host:pid:tid r<rank> [PROXY] file.cc:42 INFO pinned to core 3
#pragma once

#include <cstdint>

namespace uccl_moe::log {

enum class Level : int { NONE = 0, ERROR = 1, WARN = 2, INFO = 3, DEBUG = 4, TRACE = 5 };
enum class Subsys : uint32_t {
  INIT = 1u << 0, ENV = 1u << 1, FIFO = 1u << 2, PROXY = 1u << 3,
  NET = 1u << 4, MEM = 1u << 5, KERNEL = 1u << 6, PY = 1u << 7,
};

/// True if a message at (level, subsys) would be printed. Reads the env knobs once.
bool enabled(Level level, Subsys subsys);
void write(Level level, Subsys subsys, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));
/// Rank shown in every line (set once the process group is known; -1 = unknown).
void set_rank(int rank);
/// Parse "ALL", "PROXY,NET" or "^FIFO" into a mask (exposed for tests).
uint32_t parse_subsys_mask(const char* text);
/// Re-read the knobs (tests).
void reset();

}  // namespace uccl_moe::log

#define UCCL_LOG(LEVEL, SUBSYS, ...)                                                                       \
  do {                                                                                                     \
    if (::uccl_moe::log::enabled(::uccl_moe::log::Level::LEVEL, ::uccl_moe::log::Subsys::SUBSYS))          \
      ::uccl_moe::log::write(::uccl_moe::log::Level::LEVEL, ::uccl_moe::log::Subsys::SUBSYS, __FILE__,     \
                             __LINE__, __VA_ARGS__);                                                       \
  } while (0)

#if defined(UCCL_MOE_ENABLE_TRACE)
#define UCCL_TRACE(SUBSYS, ...) UCCL_LOG(TRACE, SUBSYS, __VA_ARGS__)
#else
#define UCCL_TRACE(SUBSYS, ...) \
  do {                          \
  } while (0)
#endif
