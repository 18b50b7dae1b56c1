// WeightWindow: the model's parameters seen one unit at a time, for initialisation, Hugging Face
// import and export and checkpoints (model/weights.h's ModelWeights). The unit stores the model
// computes with (model/unit_store.h) are windows; so are the views engines give over weights that
// live elsewhere (a GPU's, a tensor-parallel group's shards, a parameter server's ranks), which
// have no gradients to offer.
//
// acquire(u) gives unit u's parameters, complete, as `layout.units[u].size()` floats, valid until
// release(u). With for_write, the caller may change them and release(u) keeps the change; every
// rank of a sharded window must make the same calls.
#pragma once

namespace memtrain {

class WeightWindow {
  public:
    virtual ~WeightWindow() = default;
    virtual float* acquire(int u, bool for_write = false) = 0;
    virtual void release(int u) = 0;
    // The whole flat buffer, or null where this window does not hold it whole.
    virtual float* full_params() { return nullptr; }
};

}  // namespace memtrain
