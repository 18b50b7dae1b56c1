// A model's weights seen unit by unit through its UnitStore, whatever holds them: the CPU model's
// flat buffer, a ZeRO shard store, or the CUDA model (whose store copies each unit's fp32 master
// weights to the host and back). Initialisation, Hugging Face import/export and checkpoints go
// through this, so every backend gets the same bits from the same seed or file.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/param_layout.h"
#include "model/unit_store.h"

namespace memtrain {

struct ModelWeights {
    WeightWindow& store;
    const ParamLayout& layout;
    const ModelConfig& cfg;
};

// GPT-2 initialisation: N(0, init_std), residual projections scaled by 1/sqrt(2 n_layer), norm
// weights 1, biases 0, padded vocabulary rows (of wte and lm_head) 0. Draws one random stream in
// layout order, unit by unit, so every store gets the same bits.
void init_gpt2_weights(const ModelWeights& w, uint64_t seed);

// Every parameter, in layout order (padding included), as fp32 on the host. Acquires each unit
// once, so under ZeRO-3 every rank must call it.
std::vector<float> gather_params(const ModelWeights& w);

}  // namespace memtrain
