// What the per-module autograd nodes (modules_bindings.cpp, opm_node_bindings.cpp,
// triangle_node_bindings.cpp) share: optional tensors as autograd's Function sees them, which gradients
// a backward must return, stacked parameters read without a copy, and the extension's ops called
// through the dispatcher.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

#include "common/bindings_common.h"

namespace evoformer {
namespace modules {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;

inline at::Tensor value_or_undefined(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }
inline bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }
inline std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Autograd numbers a node's inputs by the tensors passed (an absent optional is none): the edge of
// each argument in `present` (whether it was given, in argument order), -1 for an absent one.
inline std::vector<int64_t> edge_table(std::initializer_list<bool> present) {
  std::vector<int64_t> edges;
  int64_t edge = 0;
  for (const bool p : present) edges.push_back(p ? edge++ : -1);
  return edges;
}

// Keeps in ctx the edge table of the forward's arguments: `present` for the first ones, absent for
// the rest up to `arguments` (non-tensor arguments at the end).
inline void save_edges(AutogradContext* ctx, std::initializer_list<bool> present, int64_t arguments) {
  std::vector<int64_t> edges = edge_table(present);
  edges.resize(arguments, -1);
  ctx->saved_data["edges"] = edges;
}

// In a backward: whether argument i was a tensor (`given`) and whether its gradient is wanted
// (`operator()`), from the table save_edges kept.
class Needs {
 public:
  explicit Needs(AutogradContext* ctx) : ctx_(ctx), edges_(ctx->saved_data.at("edges").toIntVector()) {}
  bool given(int i) const { return edges_[i] >= 0; }
  bool operator()(int i) const { return given(i) && ctx_->needs_input_grad(edges_[i]); }

 private:
  AutogradContext* ctx_;
  std::vector<int64_t> edges_;
};

// Whether `parts` lie back to back in one storage, each contiguous, with one dtype and the same
// sizes past dim 0: the rows of their stack along dim 0, in order, with no copy. The modules keep
// the parameters of each stacked projection so (evoformer_blocks/primitives.py's pack_rows).
inline bool back_to_back(at::TensorList parts) {
  const at::Tensor& first = parts[0];
  if (!first.has_storage() || first.dim() < 1) return false;
  const c10::StorageImpl* storage = first.storage().unsafeGetStorageImpl();
  const at::IntArrayRef trailing = first.sizes().slice(1);
  int64_t offset = first.storage_offset();
  for (const at::Tensor& t : parts) {
    if (!t.has_storage() || t.storage().unsafeGetStorageImpl() != storage || t.storage_offset() != offset ||
        t.scalar_type() != first.scalar_type() || t.dim() != first.dim() || t.sizes().slice(1) != trailing ||
        !t.is_contiguous())
      return false;
    offset += t.numel();
  }
  return true;
}

// `parts` stacked along dim 0 ([sum of their sizes(0), *trailing]): a view of their storage where
// they lie back to back (back_to_back), else at::cat's copy. Where the stack is a view, a node saves
// the parts themselves instead of it and stacks them again in its backward, so that an in-place
// change of a parameter between forward and backward raises autograd's error, as for a saved weight.
// `is_view`, where given, says which of the two it returned.
inline at::Tensor stacked_rows(at::TensorList parts, bool* is_view = nullptr) {
  const bool view = back_to_back(parts);
  if (is_view != nullptr) *is_view = view;
  if (!view) return at::cat(parts);
  std::vector<int64_t> sizes(parts[0].sizes().begin(), parts[0].sizes().end());
  for (size_t i = 1; i < parts.size(); ++i) sizes[0] += parts[i].size(0);
  return raw_reshape(parts[0], sizes);  // (raw_reshape: the first part's storage and offset)
}

}  // namespace modules
}  // namespace evoformer

// The extension's ops that the nodes run, called through the dispatcher (a few microseconds more than
// calling the functions), so that profiles and dispatch modes see them by name, as when the composed
// path calls them (a recompute test counts them), and see none of their inner calls: `handle()` is
// the op `name` typed as `function`.
#define EVO_OP_HANDLE(handle, name, function)                                                                \
  inline const auto& handle() {                                                                              \
    static const auto op =                                                                                   \
        c10::Dispatcher::singleton().findSchemaOrThrow("evoformer_blocks_cuda::" name, "").typed<decltype(function)>(); \
    return op;                                                                                               \
  }
