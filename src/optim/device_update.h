// What the GPU optimizer kernels are handed for one update, computed on the host from the
// parameter layout and the optimizer config: the per-tensor pieces of a parameter range and the
// per-step scalars (kernels/cuda/optimizer_types.h holds the types). Plain C++, built everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cuda/optimizer_types.h"
#include "model/param_layout.h"
#include "optim/optim_config.h"
#include "optim/state_format.h"

namespace memtrain::cuda {

// The pieces (at most max_n floats each) tiling [offset, offset + count) of the layout's flat
// buffer, split at tensor boundaries, in buffer order. Floats of the range that belong to no
// tensor (the layout has none today) get no piece, as the CPU optimizer skips them. Fails
// (memtrain::Error) when the range is outside the layout or max_n < 1.
std::vector<TensorChunk> tensor_chunks(const ParamLayout& layout, std::size_t offset,
                                       std::size_t count, int max_n = 1 << 16);

// The GPU optimizer's pieces of [offset, offset + count) under optim.state_format `format`, and
// where each piece's moments are: the stores are the CPU's MomentBuffer stores byte for byte
// (MomentBuffer::plan: an fp32 store for the tensors that keep fp32, a bf16 store, int8/int4
// codes and their fp32 scales). fp32: tensor_chunks and no table (moments indexed like the
// parameters). bf16: tensor_chunks, each with its place in the fp32 or bf16 store. int8, int4:
// the fp32-kept tensors in pieces of at most max_n, and every quantized segment one chunk (its
// first code byte and first scale) laid over one CUDA block per quantization block by `grid`.
struct MomentLayout {
    std::vector<TensorChunk> chunks;
    std::vector<StateChunk> at;   // empty for fp32
    std::vector<ChunkGrid> grid;  // int8 / int4 only: each chunk's CUDA blocks
    int64_t blocks = 0;           // the CUDA blocks of a step (chunks.size() without a grid)
    MomentBuffer::Plan plan;      // the stores' sizes (one moment's)
    // The device bytes of its tables (chunks, `at`, grid), without the decode tables.
    std::size_t table_bytes() const {
        return chunks.size() * sizeof(TensorChunk) + at.size() * sizeof(StateChunk) +
               grid.size() * sizeof(ChunkGrid);
    }
};
// `only` (per tensor of the layout, empty: every tensor): a masked moment over those tensors
// alone, as the CPU's MomentBuffer lays it (Muon's: Adam's m and v over the tensors that are not
// block matrices, the momentum over the matrices); its chunks always carry `at` (the stores are
// compact), fp32 too.
MomentLayout moment_layout(const ParamLayout& layout, std::size_t offset, std::size_t count,
                           StateFormat format, int max_n = 1 << 16,
                           const std::vector<char>& only = {});

// Muon on the GPU: the block matrices of [offset, offset + count) (muon_matrices), with their
// momentum's layout cut per matrix: matrix k's chunks are chunks[first, first + n) of
// `momentum`, and its CUDA blocks start at grid block `block0` (an int8 / int4 momentum's grid is
// rebased per matrix, so that each matrix's update is a launch of its own). Each matrix lies
// whole in the range (a range that cuts one fails, naming it), except where the range is a ZeRO
// shard (`shard`): a matrix its edge cuts is listed too, with the piece the range holds, and is
// gathered whole from its holders before its Newton-Schulz (dist::DeviceShardGather).
// `max_numel` and `max_gram` size the Newton-Schulz scratch (the matrix twice, its Gram matrix
// twice): the range's largest matrix, or for a shard the layout's largest, since every rank
// receives each matrix the shards cut.
struct MuonMatrix {
    int64_t begin;  // its first float in the range (negative: it starts before a shard)
    int32_t rows, cols, decay;
    int32_t first, n;      // its chunks in momentum.chunks
    int64_t blocks;        // its CUDA blocks
    int32_t tensor;        // its index in the layout
    int64_t piece, count;  // the floats the range holds: [piece, piece + count) of the matrix
    bool cut() const { return count != (int64_t)rows * cols; }
};
struct MuonLayout {
    std::vector<MuonMatrix> matrices;
    MomentLayout momentum;           // over the matrices (grid rebased per matrix)
    MomentLayout adam;               // Adam's m and v over the other tensors
    std::vector<char> matrix, rest;  // per tensor of the layout: the momentum's, Adam's
    std::size_t max_numel = 0, max_gram = 0;
    // The device bytes beside the moments: both chunk tables, then the decode tables, the
    // Newton-Schulz scratch and its norm (a double), which a range stepped in parts shares.
    std::size_t table_bytes(StateFormat format) const {
        return chunk_table_bytes() + shared_bytes(format);
    }
    std::size_t chunk_table_bytes() const { return adam.table_bytes() + momentum.table_bytes(); }
    std::size_t shared_bytes(StateFormat format) const;
};
MuonLayout muon_layout(const ParamLayout& layout, std::size_t offset, std::size_t count,
                       StateFormat format, bool shard = false);
// The decode tables the kernels read for `format` (MomentStores::table_m, then table_v):
// decode_code's 256 values of the signed map, then the unsigned map's; empty for fp32 and bf16.
std::vector<float> decode_tables(StateFormat format);
// The code map of a signed (Adam m, SGD momentum) or unsigned (Adam v) moment in `format`
// (int8, int4), as the kernels take it.
QuantMap quant_map(StateFormat format, bool is_signed);

// Adafactor's tables over [offset, offset + count) of `layout`: every tensor of the range, in the
// layout's order, its state back to back as the CPU's Adafactor lays it (adafactor_floats each),
// and the sizes of the kernels' grids and scratch. Each tensor must lie whole in the range (the
// GPU steps no tensor it holds part of): a range that cuts one fails, naming it, unless the
// range is a ZeRO shard (`shard`), whose cut tensors are left out (each is stepped whole from
// its gathered pieces, in a layout of its own).
struct AdafactorLayout {
    std::vector<AdafactorTensor> tensors;
    int64_t state = 0;     // floats of state
    int64_t rows = 0;      // row blocks: one double of scratch each
    int64_t items = 0;     // column-partial blocks
    int64_t tiles = 0;     // column tiles
    int64_t parts = 0;     // doubles of column partial sums
    int64_t max_cols = 0;  // the widest row
    // The device bytes beside the state: the tensor table, the per-tensor scalars and the
    // scratch of row sums and column partials.
    std::size_t table_bytes() const;
};
AdafactorLayout adafactor_layout(const ParamLayout& layout, std::size_t offset, std::size_t count,
                                 bool shard = false);

// The pieces the GPU optimizer steps [offset, offset + count) in, each with its own tables: the
// whole range, or with `by_unit` (optim.step_in_backward) each parameter unit's part of it, in
// order, so that a unit is updated alone as soon as its gradient is complete. Per tensor the
// arithmetic, the quantization blocks and the rounding draws are the same either way.
struct OptimizerPart {
    std::size_t offset = 0, n = 0;
};
std::vector<OptimizerPart> optimizer_parts(const ParamLayout& layout, std::size_t offset,
                                           std::size_t count, bool by_unit);

// The host group of StepScalars for step `step` (1-based, counting this update) of the optimizer
// cfg.name names, with the constants computed exactly as optim/optimizer.cpp computes them (double
// on the host, then rounded to float), so that the GPU update can match the CPU's bits. The device
// group is zero (finish_grad_norm fills it). max_norm is cfg.grad_clip rounded to float.
StepScalars make_step_scalars(const OptimConfig& cfg, double lr, int64_t step,
                              float loss_scale = 1.0f);

}  // namespace memtrain::cuda
