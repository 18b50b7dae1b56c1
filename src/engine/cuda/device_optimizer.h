// The optimizer of the CUDA engines on the device: fp32 master weights (when the storage type is
// not float, unless optim.master = "none": then the bf16 parameters are the only weights and each
// update rounds into them stochastically), AdamW's m and v or SGD's momentum (in any
// optim.state_format: the CPU MomentBuffer's stores byte for byte, cuda::moment_layout), Muon's
// momentum and Newton-Schulz scratch beside AdamW's m and v of the other tensors
// (cuda::muon_layout), or Adafactor's factored second moment (cuda::adafactor_layout; Muon and
// Adafactor hold each tensor of the range whole), the
// multi-tensor chunk table and the step count, over one range of a parameter layout (the whole
// model, a ZeRO-1 shard, a pipeline stage, or LoRA's adapters). It updates the T parameters from
// the T gradients with the kernels of kernels/cuda/optimizer.h, and is the engine's OptimizerState:
// checkpoints read and write its tensors and its step count through it.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/communicator.h"
#include "config/run_config.h"
#include "core/device.h"
#include "core/error.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "kernels/cuda/adafactor.h"
#include "kernels/cuda/optimizer.h"
#include "model/param_layout.h"
#include "optim/device_update.h"
#include "optim/optim_config.h"
#include "optim/optimizer.h"
#include "parallel/data/device_shard_gather.h"

namespace memtrain {

template <typename T>
class DeviceOptimizer final : public OptimizerState {
  public:
    // Waits for the engine's compute stream (naming what for: with NCCL, a dead peer fails fast).
    using Wait = std::function<void(const char* what)>;
    // Floats [offset, offset + n) of `layout`, every tensor zero; checkpoint reads and writes are
    // queued on `stream` and waited for with `wait`. `train_seed` seeds the stochastic rounding of
    // optim.master = "none" (T must be bf16 then). `by_unit` (optim.step_in_backward): the range
    // is laid out in one part per parameter unit (cuda::optimizer_parts), so step_unit updates a
    // unit alone; the state and every update are bitwise the same as in one part. `shards`
    // (Muon under GPU ZeRO 1-3: the range is this rank's shard): the block matrices the shards
    // cut are gathered whole for their Newton-Schulz, each holder updating its piece.
    DeviceOptimizer(const OptimConfig& cfg, const ParamLayout& layout, std::size_t offset,
                    std::size_t n, cudaStream_t stream, Wait wait, uint64_t train_seed = 0,
                    bool by_unit = false, dist::DeviceShardGather* shards = nullptr);
    DeviceOptimizer(const DeviceOptimizer&) = delete;
    DeviceOptimizer& operator=(const DeviceOptimizer&) = delete;
    // The fp32 master weights of the range, or null when T is float (the parameters are the
    // master) or under optim.master = "none" (the bf16 parameters are the weights).
    float* master() { return master_.size() ? master_.data() : nullptr; }
    // The fp32 weights of the range whose parameters are `params`: the master, else the
    // parameters themselves when T is float, else null (optim.master = "none": the bf16
    // parameters are the weights).
    float* master_or_params(T* params) {
        if (float* m = master()) return m;
        if constexpr (std::is_same_v<T, float>)
            return params;
        else
            return nullptr;
    }
    // One update of the range: params (T) from grads (T) scaled by the device scalars'
    // grad_scale; nothing when they say skip.
    void step(T* params, const T* grads, const cuda::StepScalars* scalars, cudaStream_t stream);
    // The same for parameter unit u, whose floats [begin, begin + n) are one part (built
    // by_unit: the unit's piece of the range; n = 0 where the range holds none of it):
    // `params` is the range's, `grads` the part's own (its first float at begin), as the step
    // inside the backward holds them. Every rank calls it for every unit, in the same order
    // (under `shards`, the gathers of the unit's cut matrices are collectives).
    void step_unit(int u, std::size_t begin, std::size_t n, T* params, const T* grads,
                   const cuda::StepScalars* scalars, cudaStream_t stream);
    std::string describe() const;  // "fp32 master, Adam m, v"

    // OptimizerState: the range, the step count (of updates taken: a skipped fp16 step is not
    // one), whole-tensor reads and ranged writes of the moments.
    std::size_t offset() const override { return offset_; }
    std::size_t count() const override { return n_; }
    int64_t steps_taken() const override { return t_; }
    void set_steps_taken(int64_t t) override { t_ = t; }
    std::vector<std::string> state_names() override;
    const float* host_state(const std::string&) override { return nullptr; }
    void read_state(const std::string& name, float* dst) override;
    void write_state(const std::string& name, std::size_t begin, std::size_t n,
                     const float* src) override;
    // Adafactor under `shards`: the written floats of the cut tensors' state, gathered among
    // their holders (every rank takes part) so that each holder has the whole state again.
    void finish_writes() override;

  private:
    // One or two moments laid out by cuda::moment_layout (Adam's m and v, SGD's momentum, or
    // Muon's: m and v over the tensors that are not block matrices, the momentum over the
    // matrices): each moment's stores as the CPU's MomentBuffer keeps them (fp32, bf16, codes,
    // scales; empty where the format has none), the chunk table, where each chunk's moments are
    // (absent for unmasked fp32) and, for int8 / int4, each chunk's CUDA blocks.
    struct MomentSet {
        DeviceBuffer<float> f32[2];
        DeviceBuffer<__nv_bfloat16> b16[2];
        DeviceBuffer<uint8_t> codes[2];
        DeviceBuffer<float> scales[2];
        DeviceBuffer<cuda::TensorChunk> chunks;
        DeviceBuffer<cuda::StateChunk> at;
        DeviceBuffer<cuda::ChunkGrid> grid;
        int64_t blocks = 0;
        std::vector<char> only;  // the tensors it covers (empty: every tensor)
        void allocate(const cuda::MomentLayout& lay, int moments);
    };
    // One part of the range (cuda::optimizer_parts) and its own tables: the moments, Muon's
    // matrices and momentum, Adafactor's state, tables and scratch.
    struct Part {
        std::size_t offset = 0, n = 0;
        MomentSet moments;  // AdamW's m, v; SGD's momentum; Muon's m, v of the rest
        // Muon: the block matrices and their momentum.
        cuda::MuonLayout muon;
        MomentSet momentum;
        // Adafactor: the tensors' state back to back, its table, the per-tensor scalars and the
        // row sums and column partials (cuda::AdafactorLayout's sizes).
        cuda::AdafactorLayout af;
        DeviceBuffer<float> af_state;
        DeviceBuffer<cuda::AdafactorTensor> af_tensors;
        DeviceBuffer<cuda::AdafactorScalars> af_scalars;
        DeviceBuffer<double> af_sums;
    };
    void allocate(Part& p);
    // Part p (null: none here) of the update, and under `shards` the gathers of every matrix
    // the shards cut whose floats start in [lo, hi) of the layout, in layout order.
    void step_part(Part* p, std::size_t lo, std::size_t hi, T* params, const T* grads,
                   const cuda::StepScalars* s, cudaStream_t stream);
    // A moment's device stores: which set of each part holds it, and whether its codes are
    // signed.
    struct Stores {
        MomentSet Part::*set;
        int k;  // 0: m or a momentum, 1: v
        bool is_signed;
    };
    Stores stores(const std::string& name);
    // The kernels' view of a set: m (and v) as the first (and second) moment; `first` rebases
    // the chunk tables to chunk `first` (a Muon matrix's), with `blocks` CUDA blocks.
    cuda::MomentStores moment_stores(MomentSet& set, std::size_t first = 0, int64_t blocks = -1);
    // The moment on the host as the CPU's MomentBuffer (its codec), from the device's bytes; and
    // its bytes back to the device.
    MomentBuffer to_host(Part& p, const Stores& st);
    void to_device(Part& p, const MomentBuffer& b, const Stores& st);
    static cuda::AdafactorStores adafactor_stores(Part& p);
    // Adafactor: part p's state as the part's n floats (checkpoints' layout) at `d`.
    void adafactor_floats(Part& p, float* d);
    // Muon's block matrices of part p (null: none) in layout order, with the gathers of the cut
    // matrices starting in [lo, hi) that this rank holds none of in their places (`params`,
    // `master` and `round` the part's).
    void muon_step(Part* p, std::size_t lo, std::size_t hi, T* params, float* master,
                   const T* grads, const cuda::StepScalars* s, cudaStream_t stream,
                   const cuda::ParamRounding& round);
    enum class Kind { AdamW, Sgd, Adafactor, Muon };
    Kind kind_ = Kind::AdamW;
    cuda::ParamRounding round_;  // optim.master = "none": stochastic
    StateFormat format_ = StateFormat::Fp32;
    ParamLayout layout_;
    std::size_t offset_ = 0, n_ = 0;
    int64_t t_ = 0;
    cudaStream_t stream_ = nullptr;
    Wait wait_;
    DeviceBuffer<float> master_;  // absent when T is float or optim.master = "none"
    std::vector<Part> parts_;
    DeviceBuffer<float> tables_;  // int8 / int4: the signed decode table, then the unsigned
    // Muon's Newton-Schulz scratch, shared by the parts (two matrices, two Gram matrices, a norm).
    DeviceBuffer<float> ns_x_, ns_y_, ns_a_, ns_b_;
    DeviceBuffer<double> ns_sumsq_;
    dist::DeviceShardGather* shards_ = nullptr;
    // Adafactor under `shards`: each cut tensor this rank holds, stepped whole in a part of its
    // own (the tensor's offset and size; in the order of shards_->cuts()), the scratch every
    // rank gathers a cut tensor's gradients and weights into (T), the fp32 scratch of its master
    // weights and of its state on a load, and write_state's floats of each held cut tensor until
    // finish_writes.
    void adafactor_cuts(std::size_t lo, std::size_t hi, T* params, const T* grads,
                        std::size_t grads_at, const cuda::StepScalars* s, cudaStream_t stream);
    Part* cut_part(std::size_t tensor);
    std::vector<Part> cut_parts_;
    DeviceBuffer<T> cut_g_, cut_w_;
    DeviceBuffer<float> cut_f_;
    std::vector<std::vector<float>> cut_staged_;
};

// Weight I/O of parameters that are their own weights (optim.master = "none", or fp32): n values
// of T on the device at `src` decoded into the host floats `dst`, and n host floats rounded to
// nearest into the device's `dst`; both queue on `stream` and wait with `wait` (the host buffers
// are reused).
template <typename T>
void download_decoded(float* dst, const T* src, std::size_t n, cudaStream_t stream,
                      const std::function<void(const char*)>& wait);
template <typename T>
void upload_rounded(T* dst, const float* src, std::size_t n, cudaStream_t stream,
                    const std::function<void(const char*)>& wait);

// The footer line with the driver's count of device memory in use against the device's size.
std::string device_in_use_line();

// Makes this rank's GPU the current device (one GPU per process: the node's ranks take the
// node's devices in turn); fails when no CUDA device answers.
void use_rank_device(const dist::Communicator& comm);

// E<float>, E<__nv_bfloat16> or E<__half> (an engine of the storage type) by the plan's
// precision, on this rank's GPU.
template <template <typename> class E>
std::unique_ptr<Engine> make_for_precision(const RunPlan& plan, dist::Communicator& comm) {
    use_rank_device(comm);
    switch (plan.precision) {
        case Precision::fp32:
            return std::make_unique<E<float>>(plan, comm);
        case Precision::bf16:
            return std::make_unique<E<__nv_bfloat16>>(plan, comm);
        case Precision::fp16:
            return std::make_unique<E<__half>>(plan, comm);
    }
    fail("internal: no storage type for the plan's precision");
}

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
