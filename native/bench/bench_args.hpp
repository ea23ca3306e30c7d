// Command-line helpers shared by the native benchmarks.
#pragma once

#include <cstdlib>
#include <vector>

namespace uccl_moe::bench {

/// "1,2,4" -> {1, 2, 4}.
inline std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

}  // namespace uccl_moe::bench
