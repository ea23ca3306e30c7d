#include "uccl_moe/env.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "uccl_moe/error.hpp"
#include "uccl_moe/log.hpp"

namespace uccl_moe::env {

const std::vector<KnobInfo>& knobs() {
  static const std::vector<KnobInfo> table = {
#define UCCL_MOE_KNOB(NAME, TYPE, DEF, MIN, MAX, DOC) {#NAME, KnobType::k##TYPE##_tag, DEF, MIN, MAX, DOC},
#define kINT_tag kInt
#define kFLOAT_tag kFloat
#define kBOOL_tag kBool
#define kSTRING_tag kString
#define kCHOICE_tag kChoice
#include "env_knobs.def"
#undef UCCL_MOE_KNOB
  };
  return table;
}

namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\n"), e = s.find_last_not_of(" \t\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

[[noreturn]] void bad(const std::string& var, const std::string& text, const std::string& want) {
  UCCL_THROW(kInvalidUsage, "UCCL_MOE_%s=\"%s\" is invalid: expected %s", var.c_str(), text.c_str(), want.c_str());
}

std::mutex g_mu;
std::unordered_map<std::string, std::string> g_cache;  // name -> validated raw text

}  // namespace

const KnobInfo& knob(const char* name) {
  for (const auto& k : knobs())
    if (std::string(k.name) == name) return k;
  UCCL_THROW(kInternal, "unknown knob %s", name);
}

int64_t parse_int(const std::string& var, const std::string& text, const std::string& min, const std::string& max) {
  std::string t = trim(text);
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(t.c_str(), &end, 0);
  if (t.empty() || *end != '\0' || errno == ERANGE) bad(var, text, "an integer");
  if (!min.empty() && v < std::strtoll(min.c_str(), nullptr, 0)) bad(var, text, "an integer >= " + min);
  if (!max.empty() && v > std::strtoll(max.c_str(), nullptr, 0)) bad(var, text, "an integer <= " + max);
  return v;
}

double parse_float(const std::string& var, const std::string& text, const std::string& min, const std::string& max) {
  std::string t = trim(text);
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(t.c_str(), &end);
  if (t.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v)) bad(var, text, "a number");
  if (!min.empty() && v < std::strtod(min.c_str(), nullptr)) bad(var, text, "a number >= " + min);
  if (!max.empty() && v > std::strtod(max.c_str(), nullptr)) bad(var, text, "a number <= " + max);
  return v;
}

bool parse_bool(const std::string& var, const std::string& text) {
  std::string t = trim(text);
  for (auto& c : t) c = static_cast<char>(std::tolower(c));
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  bad(var, text, "a boolean (1/0, true/false, yes/no, on/off)");
}

std::string parse_choice(const std::string& var, const std::string& text, const std::string& choices) {
  std::string t = trim(text);
  std::stringstream ss(choices);
  std::string c;
  while (std::getline(ss, c, '|'))
    if (c == t) return t;
  bad(var, text, "one of " + choices);
}

std::string raw(const KnobInfo& info) {
  std::string var = std::string("UCCL_MOE_") + info.name;
  const char* v = std::getenv(var.c_str());
  return (v && *v) ? std::string(v) : std::string(info.default_value);
}

namespace {
// Validates a knob's raw text once and caches it; logs non-defaults once.
std::string validated(const char* name) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_cache.find(name);
  if (it != g_cache.end()) return it->second;
  const KnobInfo& k = knob(name);
  std::string text = raw(k);
  switch (k.type) {
    case KnobType::kInt: parse_int(k.name, text, k.min_or_choices, k.max_value); break;
    case KnobType::kFloat: parse_float(k.name, text, k.min_or_choices, k.max_value); break;
    case KnobType::kBool: parse_bool(k.name, text); break;
    case KnobType::kChoice: parse_choice(k.name, text, k.min_or_choices); break;
    case KnobType::kString: break;
  }
  if (text != k.default_value) UCCL_LOG(INFO, ENV, "UCCL_MOE_%s=%s (default %s)", k.name, text.c_str(), k.default_value);
  g_cache.emplace(name, text);
  return text;
}
}  // namespace

void reset_cache() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_cache.clear();
}

#define UCCL_MOE_GET_INT(NAME, MIN, MAX) return parse_int(#NAME, validated(#NAME), MIN, MAX);
#define UCCL_MOE_GET_FLOAT(NAME, MIN, MAX) return parse_float(#NAME, validated(#NAME), MIN, MAX);
#define UCCL_MOE_GET_BOOL(NAME, MIN, MAX) return parse_bool(#NAME, validated(#NAME));
#define UCCL_MOE_GET_STRING(NAME, MIN, MAX) return validated(#NAME);
#define UCCL_MOE_GET_CHOICE(NAME, MIN, MAX) return validated(#NAME);
#define UCCL_MOE_KNOB(NAME, TYPE, DEF, MIN, MAX, DOC) \
  UCCL_MOE_KNOB_##TYPE NAME() { UCCL_MOE_GET_##TYPE(NAME, MIN, MAX) }
#include "env_knobs.def"
#undef UCCL_MOE_KNOB

}  // namespace uccl_moe::env
