// Binds a launcher's plain argument struct (intranode::DispatchArgs, ...) as a Python class: one named read-write
// attribute per field and a keyword-only constructor, so Python builds it by field name and a binding takes one
// struct instead of a long positional list. Pointer fields cross as ints (device addresses, 0 = null), like every
// other pointer of this module; the struct itself stays torch-free and trivially copyable. The constructor is an
// ordinary nanobind signature (one keyword per field), so a call costs what a call with those keywords costs, and a
// misspelt or mistyped field is refused with the signature in the message.
//
//   bind_args(m, "NotifyArgs", "doc", UCCL_MOE_ARG(NotifyArgs, num_tokens), UCCL_MOE_ARG(NotifyArgs, lane_prefix));
#pragma once

#include <nanobind/nanobind.h>

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>

namespace uccl_moe::bindings {

/// One field of an argument struct: its member pointer (the template argument) and its Python name.
template <auto M>
struct ArgField {
  const char* name;
};
#define UCCL_MOE_ARG(Struct, field) ::uccl_moe::bindings::ArgField<&Struct::field>{#field}

namespace args_detail {

template <typename M>
struct MemberOf;
template <typename S, typename T>
struct MemberOf<T S::*> {
  using Struct = S;
  using Type = T;
};
template <auto M>
using FieldType = typename MemberOf<decltype(M)>::Type;
template <auto M>
using StructOf = typename MemberOf<decltype(M)>::Struct;
/// The Python-side type of a field: pointers as uintptr_t, the rest as declared.
template <auto M>
using PyType = std::conditional_t<std::is_pointer_v<FieldType<M>>, uintptr_t, FieldType<M>>;

template <auto M>
void set(StructOf<M>& s, PyType<M> v) {
  if constexpr (std::is_pointer_v<FieldType<M>>)
    s.*M = reinterpret_cast<FieldType<M>>(v);
  else
    s.*M = v;
}
template <auto M>
PyType<M> get(const StructOf<M>& s) {
  if constexpr (std::is_pointer_v<FieldType<M>>)
    return reinterpret_cast<uintptr_t>(s.*M);
  else
    return s.*M;
}

}  // namespace args_detail

template <auto M0, auto... Ms>
void bind_args(nanobind::module_& m, const char* name, const char* doc, ArgField<M0> f0, ArgField<Ms>... fs) {
  namespace nb = nanobind;
  using namespace args_detail;
  using S = StructOf<M0>;
  static_assert((std::is_same_v<S, StructOf<Ms>> && ...), "every field belongs to one struct");
  static_assert(std::is_trivially_copyable_v<S> && std::is_trivially_destructible_v<S>,
                "argument structs are plain data (the launchers take them by value)");
  static_assert(((std::is_pointer_v<FieldType<Ms>> || std::is_arithmetic_v<FieldType<Ms>>) && ...) &&
                    (std::is_pointer_v<FieldType<M0>> || std::is_arithmetic_v<FieldType<M0>>),
                "argument struct fields are integers, bools or pointers");
  nb::class_<S> cls(m, name, doc);
  cls.def(
      "__init__",
      [](S* self, PyType<M0> v0, PyType<Ms>... vs) {
        new (self) S{};
        set<M0>(*self, v0);
        (set<Ms>(*self, vs), ...);
      },
      nb::kw_only(), nb::arg(f0.name) = PyType<M0>{}, (nb::arg(fs.name) = PyType<Ms>{})...,
      "Keyword-only: every field by name; unset fields are 0 (null pointers)");
  cls.def_prop_rw(f0.name, &get<M0>, &set<M0>);
  (cls.def_prop_rw(fs.name, &get<Ms>, &set<Ms>), ...);
  const std::string cls_name = name;
  const std::array<const char*, 1 + sizeof...(Ms)> names{f0.name, fs.name...};
  cls.def("__repr__", [cls_name, names](const S& s) {
    const std::array<nb::object, 1 + sizeof...(Ms)> values{nb::cast(get<M0>(s)), nb::cast(get<Ms>(s))...};
    std::string out = cls_name + "(";
    for (size_t i = 0; i < names.size(); ++i)
      out += std::string(i ? ", " : "") + names[i] + "=" + nb::cast<std::string>(nb::repr(values[i]));
    return out + ")";
  });
}

}  // namespace uccl_moe::bindings
