// What the single-model CUDA engine (cuda_engine.cpp) trains and where it keeps it, chosen once
// from the run plan: the whole model (whole_model_states.h: DDP or ZeRO 1-3 over NCCL, the
// optimizer on the device or, ZeRO-Offload, on the host) or LoRA's adapters over a frozen base,
// whole or QLoRA-packed (adapter_states.h). The engine runs the same step over either: it owns
// the stream, the step's arithmetic (DeviceStep) and the model's calls; a ModelStates owns the
// parameters, gradients, optimizer, their collectives and weight I/O.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "engine/cuda/device_step.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "model/cuda_gpt.h"

namespace memtrain {

template <typename T>
class ModelStates : public StepCollectives<T> {
  public:
    // The model over these states; null until weights_loaded() builds it (QLoRA: over the base
    // packed once its weights are in).
    virtual CudaGPT<T>* model() = 0;
    // Parameters as fp32 units for initialisation, import and checkpoints.
    virtual ModelWeights weights() = 0;
    // The weights are in (initialised or imported); the model follows `remat`.
    virtual void weights_loaded(const RematPlan& /*remat*/) {}
    virtual CheckpointModel checkpoint_model() { return hf_checkpoint_model(weights()); }

    // A step: the gradients to zero; around each micro-batch's backward (`last`: the step's
    // last, micro-batch `index` of the run); before an evaluation or logits.
    virtual void begin_step() = 0;
    virtual void before_backward(bool last, int64_t index) = 0;
    virtual void after_backward() = 0;
    virtual void before_eval() {}

    // optim.step_in_backward with one micro-batch per step (only the whole model's states say
    // true): the next backward sums each unit's reduced gradient's squares into unit_sq[u]
    // (a norm pass) and, with `update`, also updates the unit with those scalars as soon as its
    // gradient is complete; disarm after it.
    virtual bool steps_in_backward() const { return false; }
    virtual void arm(double* /*unit_sq*/, const cuda::StepScalars* /*update*/) {}
    virtual void disarm() {}

    // The memory report: the rows these states and the model allocate for B x T_ under `remat`
    // (the plan's rows, engine/device_memory.h, then any sized once built), the lines under it,
    // and what the engine's description and title add (", LoRA r=4 ...").
    virtual std::vector<MemoryPrediction> predicted_memory(const RematPlan& remat, int B,
                                                           int T_) const = 0;
    virtual std::string memory_footer() const = 0;
    virtual std::string describe() const { return ""; }
    virtual std::string title() const { return ""; }

    // Test hook: ZeRO-3's gathers, and how many were made on acquire ({0, 0} below stage 3).
    virtual std::pair<int64_t, int64_t> zero_gathers() const { return {0, 0}; }
};

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
