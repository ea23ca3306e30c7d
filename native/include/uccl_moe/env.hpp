// Typed access to the environment knobs declared in env_knobs.def (the single table).
// Each knob is parsed once on first use; a malformed or out-of-range value throws InvalidUsage naming the
// variable. Values that differ from the default are logged once at INFO/ENV.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace uccl_moe::env {

enum class KnobType { kInt, kFloat, kBool, kString, kChoice };

struct KnobInfo {
  const char* name;  ///< without the UCCL_MOE_ prefix
  KnobType type;
  const char* default_value;
  const char* min_or_choices;
  const char* max_value;
  const char* doc;
};

/// All knobs in table order.
const std::vector<KnobInfo>& knobs();
/// One knob by name (without prefix); throws Internal for an unknown name.
const KnobInfo& knob(const char* name);

/// Parsers (exposed for tests). Throw InvalidUsage naming `var` on bad text.
int64_t parse_int(const std::string& var, const std::string& text, const std::string& min, const std::string& max);
double parse_float(const std::string& var, const std::string& text, const std::string& min, const std::string& max);
bool parse_bool(const std::string& var, const std::string& text);
std::string parse_choice(const std::string& var, const std::string& text, const std::string& choices);

/// Raw text of a knob: the environment's value if set (non-empty), else the default.
std::string raw(const KnobInfo& info);

// Typed getters, one per knob: uccl_moe::env::TIMEOUT_S(), ... Values are cached after the first call;
// reset_cache() re-reads (tests).
#define UCCL_MOE_KNOB_INT int64_t
#define UCCL_MOE_KNOB_FLOAT double
#define UCCL_MOE_KNOB_BOOL bool
#define UCCL_MOE_KNOB_STRING std::string
#define UCCL_MOE_KNOB_CHOICE std::string
#define UCCL_MOE_KNOB(NAME, TYPE, DEF, MIN, MAX, DOC) UCCL_MOE_KNOB_##TYPE NAME();
#include "env_knobs.def"
#undef UCCL_MOE_KNOB

void reset_cache();

}  // namespace uccl_moe::env
