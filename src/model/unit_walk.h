// The schedule of a model's step over its parameter units, written once for both drivers (GPT on
// the CPU, model/gpt.h; CudaGPT<T> on the GPU, model/cuda_gpt.h): which part runs in which order,
// which unit each part computes with, which unit it announces to the store while it runs
// (UnitStore::prefetch / DeviceUnitStore::prefetch_params, so ZeRO-3 gathers it meanwhile), and
// what a block's backward first re-runs under its remat plan. A driver walks the list and supplies
// the kernels of each part; a technique that changes the schedule (how far ahead to gather, a new
// BlockKeep, a stage boundary) changes this file, and both engines follow.
//
//   forward:   embedding   block b0 ... block b1-1   head (ln_f)
//   backward:  head (loss, ln_f)   block b1-1 ... block b0   embedding
//
// A pipeline stage walks only the parts it holds (the embedding on the first stage, the head on
// the last); a unit of another stage is never announced.
#pragma once

#include <cstdint>
#include <vector>

#include "model/activation_layout.h"
#include "model/param_layout.h"

namespace memtrain {

// What a block's backward re-runs before it, by what its forward kept (BlockKeep).
enum class Redo : uint8_t {
    Nothing,        // All: every saved field is there
    Selective,      // Selective: ln_1, ln_2 and the MLP activation are recomputed
    Block,          // Input: the whole block forward again from its input
    BlockFromHost,  // Offload: the same, once the input is back from host memory (GPU only)
};
Redo redo_for(BlockKeep k);

struct UnitVisit {
    enum class Part : uint8_t { Embedding, Block, Head };
    Part part = Part::Block;
    int block = -1;             // Part::Block: the model block
    int unit = -1;              // the parameter unit the part computes with
    int prefetch = -1;          // the unit to announce while it runs; -1: none
    Redo redo = Redo::Nothing;  // backward of a block only
};

struct UnitWalk {
    std::vector<UnitVisit> forward, backward;
};

// The walk of blocks [b0, b1) of a model of `layout` (n_layer blocks), with the embedding when
// b0 == 0 and the head when b1 == n_layer. `tied`: the classifier reads wte, so the head's forward
// announces the embedding unit. `plan`: one BlockKeep per block of [b0, b1) (empty: All).
UnitWalk make_unit_walk(const ParamLayout& layout, int n_layer, bool tied, int b0, int b1,
                        const RematPlan& plan);

}  // namespace memtrain
