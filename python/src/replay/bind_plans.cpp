/// @file
/// The binding's ids and plans: StepPlan, an engine step's requests in batch order, built from
/// request ids (int or str), from handles in columns (one native pass over the engine's arrays), or
/// from the positions the engine gives; and reading integer columns from numpy arrays or sequences.
#include "bindings.hpp"

#include <routing_replay/errors.hpp>
#include <routing_replay/step_plan.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

using namespace nb::literals;

namespace routing_replay::python {

/// Reads a 1-D integer column (a numpy array of any integer dtype, or a sequence) into `out` as
/// int64, keeping out's capacity: one pass, no Python object per element for arrays.
void read_column(nb::handle column, std::vector<std::int64_t>& out, const char* what)
{
  nb::ndarray<nb::ro, nb::ndim<1>, nb::device::cpu> array;
  if (!nb::try_cast(column, array)) {
    try {
      out = nb::cast<std::vector<std::int64_t>>(column);
    } catch (const nb::cast_error&) {
      throw nb::type_error((std::string{what} + ": expected a 1-D integer array or sequence").c_str());
    }
    return;
  }
  const auto& t = array.dtype();
  if ((t.code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int) &&
       t.code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt)) ||
      t.lanes != 1) {
    throw nb::type_error((std::string{what} + ": expected a 1-D integer array or sequence").c_str());
  }
  const dtype_code d = dtype_from_dlpack(t);
  out.resize(array.shape(0));
  // uint64 handles keep their bits through the int64 cast, and are cast back by from_bits()
  visit_dtype(d, [&](auto tag) {
    using T         = decltype(tag);
    const auto* in  = static_cast<const T*>(array.data());
    const auto step = array.stride(0);
    for (std::size_t i = 0; i < out.size(); ++i) { out[i] = static_cast<std::int64_t>(in[static_cast<std::int64_t>(i) * step]); }
  });
}

namespace {

// ---- plans --------------------------------------------------------------------------------------

void plan_schedule(plan_holder& p, nb::handle id, std::int64_t first_position, std::int32_t num_tokens,
                   std::int32_t num_draft_tokens, nb::handle slots)
{
  scheduled_request r{key_of(id), first_position, num_tokens, num_draft_tokens, {}};
  if (!r.id.is_integer()) {
    p.ids.emplace_back(r.id.string());
    r.id = request_key{std::string_view{p.ids.back()}};
  }
  if (!slots.is_none()) {
    p.slots.push_back(int64_list(slots));
    r.slots = p.slots.back();
  }
  p.plan.schedule(r);
}

/// Schedules request i for counts[i] rows at the positions the engine gives, in batch order: each
/// request's positions must be consecutive within the step (chunked prefill, decode, drafts).
void plan_from_positions(plan_holder& p, nb::handle ids, nb::handle counts, nb::handle positions)
{
  const std::vector<std::int64_t> n   = int64_list(counts);
  const std::vector<std::int64_t> pos = int64_list(positions);
  const auto num_ids                  = static_cast<std::size_t>(nb::len(ids));
  if (num_ids != n.size()) {
    throw error{errc::invalid_plan, std::to_string(num_ids) + " request ids for " + std::to_string(n.size()) +
                                      " token counts"};
  }
  std::size_t row = 0;
  std::size_t i   = 0;
  for (nb::handle id : ids) {
    const std::int64_t count = n[i++];
    if (count == 0) { continue; }
    const std::int64_t first = run_first_position(id, pos.data(), pos.size(), row, count);
    plan_schedule(p, id, first, static_cast<std::int32_t>(count), 0, nb::none());
    row += static_cast<std::size_t>(count);
  }
}

/// A 1-D integer column as schedule_handles() reads it: in place when the array is contiguous and
/// holds 64-bit integers, or 32-bit signed ones where `int32_too` (what engines keep: 64-bit handles
/// and positions, 32- or 64-bit counts); otherwise converted into `scratch` as int64 (read_column).
struct int_column {
  const void* data   = nullptr;
  std::size_t size   = 0;
  std::size_t bytes  = sizeof(std::int64_t);  ///< width of an element: 8, or 4 (int32)
};

int_column column_in_place(nb::handle column, std::vector<std::int64_t>& scratch, const char* what, bool int32_too)
{
  nb::ndarray<nb::ro, nb::ndim<1>, nb::device::cpu> array;
  if (nb::try_cast(column, array) && (array.shape(0) <= 1 || array.stride(0) == 1)) {
    const auto& t      = array.dtype();
    const bool is_int  = t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int);
    const bool is_uint = t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt);
    if (t.lanes == 1 && (is_int || is_uint) && t.bits == 64) { return {array.data(), array.shape(0), 8}; }
    if (t.lanes == 1 && is_int && t.bits == 32 && int32_too) { return {array.data(), array.shape(0), 4}; }
  }
  read_column(column, scratch, what);
  return {scratch.data(), scratch.size(), sizeof(std::int64_t)};
}

/// The entries of schedule_handles(), from columns of these element types (uint64 handles keep
/// their bits through an int64 array, and are cast back by from_bits()).
template <class Count>
void schedule_columns(step_plan& plan, const std::uint64_t* handles, const std::int64_t* first, const Count* count,
                      const std::int64_t* drafts, std::size_t n)
{
  constexpr std::int64_t int32_max = std::numeric_limits<std::int32_t>::max();
  for (std::size_t i = 0; i < n; ++i) {
    const auto tokens = static_cast<std::int64_t>(count[i]);
    const std::int64_t d = drafts != nullptr ? drafts[i] : 0;
    if (tokens < 0 || tokens > int32_max || d < 0 || d > int32_max) [[unlikely]] {
      throw error{errc::invalid_plan, "schedule_handles: entry " + std::to_string(i) + " has " + std::to_string(tokens) +
                                        " tokens and " + std::to_string(d) + " drafts"};
    }
    plan.schedule(request_handle::from_bits(handles[i]), first[i], static_cast<std::int32_t>(tokens),
                  static_cast<std::int32_t>(d));
  }
}

/// Appends requests by handle, columnar: handles[i] (as add_request returned them) with
/// num_tokens[i] tokens from first_positions[i], and num_draft_tokens[i] trailing drafts. One native
/// pass over the arrays: no Python object and no id hashing per request.
void plan_schedule_handles(plan_holder& p, nb::handle handles, nb::handle first_positions, nb::handle num_tokens,
                           nb::handle num_draft_tokens)
{
  // Read in place where the engine's arrays allow it: at decode batch 1024, copying the columns
  // first cost as much again as writing the plan's entries.
  auto& [h_scratch, first_scratch, count_scratch, draft_scratch] = p.columns;
  const int_column h     = column_in_place(handles, h_scratch, "schedule_handles: handles", false);
  const int_column first = column_in_place(first_positions, first_scratch, "schedule_handles: first_positions", false);
  const int_column count = column_in_place(num_tokens, count_scratch, "schedule_handles: num_tokens", true);
  const bool with_drafts = !num_draft_tokens.is_none();
  if (with_drafts) { read_column(num_draft_tokens, draft_scratch, "schedule_handles: num_draft_tokens"); }
  if (first.size != h.size || count.size != h.size || (with_drafts && draft_scratch.size() != h.size)) {
    throw error{errc::invalid_plan, "schedule_handles: " + std::to_string(h.size) + " handles, " +
                                      std::to_string(first.size) + " first positions, " + std::to_string(count.size) +
                                      " token counts" +
                                      (with_drafts ? ", " + std::to_string(draft_scratch.size()) + " draft counts" : "")};
  }
  const auto* hs     = static_cast<const std::uint64_t*>(h.data);
  const auto* firsts = static_cast<const std::int64_t*>(first.data);
  const std::int64_t* drafts = with_drafts ? draft_scratch.data() : nullptr;
  if (count.bytes == 4) {
    schedule_columns(p.plan, hs, firsts, static_cast<const std::int32_t*>(count.data), drafts, h.size);
  } else {
    schedule_columns(p.plan, hs, firsts, static_cast<const std::int64_t*>(count.data), drafts, h.size);
  }
}

}  // namespace

void bind_plans(nb::module_& m)
{
  nb::class_<plan_holder>(m, "StepPlan",
                              "The plan of one engine step (routing_replay::step_plan): requests in batch order, "
                              "with the positions of their tokens. Build one and clear() it every step.")
    .def(nb::init<>())
    .def("schedule", &plan_schedule, "id"_a, "first_position"_a, "num_tokens"_a, "num_draft_tokens"_a = 0,
         "slots"_a.none() = nb::none(),
         "Appends a request's tokens: rows first..first+num_tokens-1 of the step are positions "
         "first_position... of the request; the last num_draft_tokens are speculative drafts; slots (block_slot "
         "storage) gives one KV slot per token.")
    .def("skip", [](plan_holder& p, std::int32_t n) { p.plan.skip(n); }, "num_tokens"_a,
         "Appends tokens of requests that did not ask for routing.")
    .def("schedule_handles", &plan_schedule_handles, "handles"_a, "first_positions"_a, "num_tokens"_a,
         "num_draft_tokens"_a.none() = nb::none(),
         "Appends requests by handle, in batch order, from columns (numpy arrays of any integer dtype, or "
         "sequences): handles[i] as add_request returned it, with num_tokens[i] tokens at positions "
         "first_positions[i]..., the last num_draft_tokens[i] of them speculative drafts. One native pass: no "
         "Python object and no id lookup per request.")
    .def("schedule_positions", &plan_from_positions, "ids"_a, "num_tokens"_a, "positions"_a,
         "Appends requests ids[i] with num_tokens[i] tokens each, in batch order, at the positions the engine "
         "gives (one per token, consecutive within a request).")
    .def("add_fresh_blocks",
         [](plan_holder& p, nb::handle blocks) { p.plan.add_fresh_blocks(int64_list(blocks)); },
         "block_ids"_a, "Block-slot storage: KV blocks newly allocated for this step.")
    .def("set_padded_rows", [](plan_holder& p, std::int64_t rows) { p.plan.set_padded_rows(rows); }, "rows"_a,
         "Rows the forward writes including padding (a CUDA graph recorded for a padded batch).")
    .def("clear", &plan_holder::clear, "Empties the plan.")
    .def_prop_ro("num_rows", [](const plan_holder& p) { return p.plan.num_rows(); }, "N: rows of the step.")
    .def("__len__", [](const plan_holder& p) { return p.plan.entries().size(); }, "Runs in the plan.");
}

}  // namespace routing_replay::python
