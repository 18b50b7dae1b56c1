// UnitStore: where the model's parameters and gradients live, one unit at a time (units are the
// embedding, each block and the head; see ParamUnit). The model asks for a unit's parameters just
// before it uses them and says when it is done, and tells the store when backward has written
// the last gradient of a unit. A single process keeps everything whole (FullUnitStore); the
// data-parallel engine (parallel/data/zero_store.h) implements the same calls to gather ZeRO-3
// parameter shards just in time and to reduce each unit's gradients as soon as backward has
// produced them.
//
// Call pattern of one training micro-batch (u: unit index):
//     acquire(u) prefetch(next) ... release(u)   forward, for every unit in order
//     unit_grads(u) ... grads_done(u)            backward, head first, embedding last
// A unit may be acquired again after release (tied embeddings, backward); acquire/release pairs
// nest per unit and the pointer stays valid until the matching release. prefetch(v) announces
// the unit the caller will acquire next, so a store that gathers parameters can start fetching
// it while the caller computes.
#pragma once

#include <cstddef>

#include "core/allocator.h"
#include "model/param_layout.h"
#include "model/weight_window.h"

namespace memtrain {

// A unit store is also the WeightWindow its weights are loaded and saved through.
class UnitStore : public WeightWindow {
  public:
    // The whole flat buffers, or null where this store does not hold them whole (ZeRO-3
    // parameters, ZeRO-2/3 gradients).
    float* full_params() override = 0;
    virtual float* full_grads() = 0;

    // acquire(u) / release(u) as WeightWindow's: unit u's parameters, complete, valid until
    // release(u) (for_write: loading and initialising weights).
    // A hint: unit u is the next one this caller will acquire (ZeRO-3 starts gathering it now).
    // Results never depend on it, but a sharded store communicates on it, so every rank must make
    // the same calls, as with acquire.
    virtual void prefetch(int /*u*/) {}

    // Where backward accumulates unit u's gradients (the unit's floats), valid until
    // grads_done(u); the store zeroes them at the start of each step.
    virtual float* unit_grads(int u) = 0;
    // Backward will write no more gradients of unit u in this micro-batch.
    virtual void grads_done(int u) = 0;

    // Starts a step: gradients become zero.
    virtual void zero_grads() = 0;
};

// Everything whole, in two flat buffers (the gradients allocated on first use, so inference never
// pays for them). acquire/release and grads_done cost nothing.
class FullUnitStore final : public UnitStore {
  public:
    explicit FullUnitStore(const ParamLayout& layout);
    float* full_params() override { return params_.data(); }
    float* full_grads() override;
    float* acquire(int u, bool) override { return params_.data() + layout_->units[u].begin; }
    void release(int) override {}
    float* unit_grads(int u) override { return full_grads() + layout_->units[u].begin; }
    void grads_done(int) override {}
    void zero_grads() override;

  private:
    const ParamLayout* layout_;
    Buffer<float> params_;
    Buffer<float> grads_;
};

}  // namespace memtrain
