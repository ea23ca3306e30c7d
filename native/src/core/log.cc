#include "uccl_moe/log.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe::log {
namespace {

struct Subsys_name {
  const char* name;
  Subsys bit;
};
constexpr Subsys_name kSubsysNames[] = {{"INIT", Subsys::INIT}, {"ENV", Subsys::ENV},       {"FIFO", Subsys::FIFO},
                                        {"PROXY", Subsys::PROXY}, {"NET", Subsys::NET},     {"MEM", Subsys::MEM},
                                        {"KERNEL", Subsys::KERNEL}, {"PY", Subsys::PY}};
constexpr uint32_t kAllSubsys = 0xffu;

std::atomic<int> g_level{-1};  // -1 = not read yet
std::atomic<uint32_t> g_mask{0};
std::atomic<int> g_rank{-1};
std::mutex g_write_mu;

const char* level_name(Level l) {
  switch (l) {
    case Level::ERROR: return "ERROR";
    case Level::WARN: return "WARN";
    case Level::INFO: return "INFO";
    case Level::DEBUG: return "DEBUG";
    case Level::TRACE: return "TRACE";
    default: return "NONE";
  }
}

const char* subsys_name(Subsys s) {
  for (const auto& n : kSubsysNames)
    if (n.bit == s) return n.name;
  return "?";
}

void load() {
  // Read the raw text, not the validated getter: a bad LOG_LEVEL must not recurse into logging.
  int level = 2;
  static const char* kNames[] = {"NONE", "ERROR", "WARN", "INFO", "DEBUG", "TRACE"};
  std::string lv = env::raw(env::knob("LOG_LEVEL"));
  for (int i = 0; i < 6; ++i)
    if (lv == kNames[i]) level = i;
  g_mask.store(parse_subsys_mask(env::raw(env::knob("LOG_SUBSYS")).c_str()), std::memory_order_relaxed);
  g_level.store(level, std::memory_order_release);
}

}  // namespace

uint32_t parse_subsys_mask(const char* text) {
  std::string t(text ? text : "");
  if (t.empty() || t == "ALL") return kAllSubsys;
  bool invert = t[0] == '^';
  if (invert) t = t.substr(1);
  uint32_t mask = 0;
  size_t pos = 0;
  while (pos <= t.size()) {
    size_t comma = t.find(',', pos);
    std::string item = t.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    for (const auto& n : kSubsysNames)
      if (item == n.name) mask |= static_cast<uint32_t>(n.bit);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return invert ? (kAllSubsys & ~mask) : mask;
}

bool enabled(Level level, Subsys subsys) {
  int cur = g_level.load(std::memory_order_acquire);
  if (cur < 0) {
    load();
    cur = g_level.load(std::memory_order_acquire);
  }
  return static_cast<int>(level) <= cur && (g_mask.load(std::memory_order_relaxed) & static_cast<uint32_t>(subsys));
}

void write(Level level, Subsys subsys, const char* file, int line, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::string msg = detail::vformat(fmt, args);
  va_end(args);
  char host[64] = {0};
  gethostname(host, sizeof(host) - 1);
  const char* base = std::strrchr(file, '/');
  std::lock_guard<std::mutex> lock(g_write_mu);
  std::fprintf(stderr, "%s:%d:%ld r%d [%s] %s:%d %s %s\n", host, static_cast<int>(getpid()),
               static_cast<long>(syscall(SYS_gettid)), g_rank.load(), subsys_name(subsys), base ? base + 1 : file, line,
               level_name(level), msg.c_str());
}

void set_rank(int rank) { g_rank.store(rank); }

void reset() { g_level.store(-1, std::memory_order_release); }

}  // namespace uccl_moe::log
