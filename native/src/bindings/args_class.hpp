// Binds a launcher's plain argument struct (intranode::DispatchArgs, ...) as a Python class: one named read-write
// attribute per field and a keyword-only constructor, so Python builds it by field name and a binding takes one
// struct instead of a long positional list. Pointer fields cross as ints (device addresses, 0 = null), like every
// other pointer of this module; the struct itself stays torch-free and trivially copyable.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace uccl_moe::bindings {

template <typename S>
class ArgsClass {
  static_assert(std::is_trivially_copyable_v<S> && std::is_trivially_destructible_v<S>,
                "argument structs are plain data (the launchers take them by value)");

 public:
  ArgsClass(nanobind::module_& m, const char* name, const char* doc)
      : cls_(m, name, doc), name_(name), fields_(std::make_shared<Fields>()) {}
  ArgsClass(const ArgsClass&) = delete;
  ArgsClass& operator=(const ArgsClass&) = delete;

  /// Field `name` of the struct (an integer, bool or pointer member). Unset fields are zero (null pointers).
  template <typename T>
  ArgsClass& field(const char* name, T S::*member) {
    namespace nb = nanobind;
    Field f;
    if constexpr (std::is_pointer_v<T>) {
      cls_.def_prop_rw(
          name, [member](const S& s) { return reinterpret_cast<uintptr_t>(s.*member); },
          [member](S& s, uintptr_t v) { s.*member = reinterpret_cast<T>(v); });
      f.set = [member](S& s, nb::handle v) { s.*member = reinterpret_cast<T>(nb::cast<uintptr_t>(v)); };
      f.get = [member](const S& s) { return nb::cast(reinterpret_cast<uintptr_t>(s.*member)); };
    } else {
      static_assert(std::is_arithmetic_v<T>, "argument struct fields are integers, bools or pointers");
      cls_.def_rw(name, member);
      f.set = [member](S& s, nb::handle v) { s.*member = nb::cast<T>(v); };
      f.get = [member](const S& s) { return nb::cast(s.*member); };
    }
    fields_->order.emplace_back(name);
    fields_->by_name.emplace(name, std::move(f));
    return *this;
  }

  /// Adds the keyword-only constructor and __repr__ (call once, after the last field).
  void finish() {
    namespace nb = nanobind;
    auto fields = fields_;
    std::string cls_name = name_;
    cls_.def("__init__", [fields, cls_name](S* self, nb::kwargs kwargs) {
      new (self) S{};
      for (auto [key, value] : kwargs) {
        const std::string k = nb::cast<std::string>(key);
        auto it = fields->by_name.find(k);
        if (it == fields->by_name.end())
          throw nb::type_error((cls_name + " has no field '" + k + "'").c_str());
        try {
          it->second.set(*self, value);
        } catch (const nb::cast_error&) {
          throw nb::type_error((cls_name + "." + k + ": cannot take " + nb::cast<std::string>(nb::repr(value)) +
                                " (" + nb::cast<std::string>(value.type().attr("__name__")) + ")")
                                   .c_str());
        }
      }
    }, "Keyword-only: every field by name; unset fields are 0 (null pointers)");
    cls_.def("__repr__", [fields, cls_name](const S& s) {
      std::string out = cls_name + "(";
      for (size_t i = 0; i < fields->order.size(); ++i) {
        const std::string& n = fields->order[i];
        out += (i ? ", " : "") + n + "=" + nb::cast<std::string>(nb::repr(fields->by_name.at(n).get(s)));
      }
      return out + ")";
    });
  }

 private:
  struct Field {
    std::function<void(S&, nanobind::handle)> set;
    std::function<nanobind::object(const S&)> get;
  };
  struct Fields {
    std::vector<std::string> order;
    std::unordered_map<std::string, Field> by_name;
  };
  nanobind::class_<S> cls_;
  std::string name_;
  std::shared_ptr<Fields> fields_;
};

}  // namespace uccl_moe::bindings
