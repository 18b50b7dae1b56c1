// Data parallelism with ZeRO sharding (Rajbhandari et al.), as a UnitStore the model runs on.
// Every rank runs the same model on its own rows of the global batch; this store decides what
// each rank keeps of the model states and when gradients and parameters travel:
//
//   stage  parameters    gradients              optimizer state   communication per step
//   0      whole         whole, all-reduced     whole             all-reduce per unit (DDP)
//   1      whole         whole, reduce-scatter  this rank's shard reduce-scatter + all-gather
//   2      whole         this rank's shard      this rank's shard reduce-scatter per unit and
//                                                                 micro-batch + all-gather
//   3      shard         this rank's shard      this rank's shard all-gather per unit use +
//                                                                 reduce-scatter as stage 2
//
// A rank's shard is its balanced piece of the flat parameter buffer (dist::grain_shard_ranges), the
// same for parameters, gradients and optimizer state, so the optimizer of rank r updates the
// floats [offset_r, offset_r + count_r) and nothing else.
//
// Gradients are reduced unit by unit (embedding, blocks, head) as soon as backward has finished a
// unit: a unit is DDP's bucket. Every reduction is started nonblocking at grads_done and travels
// while backward computes the next units (each later unit lets it progress); it is completed at
// the latest point its result is needed:
//   - stage 0 all-reduces in place and waits when the gradients are first read (clip_grad_norm,
//     owned_grads);
//   - stages 1-3 reduce-scatter into a piece buffer and complete in start order: when the piece
//     has arrived (checked at every later unit), when starting one more would put more than
//     kMaxReducing in flight (so at most that many gradient buckets wait on the network), when
//     backward needs the unit's bucket again (next micro-batch), or when the gradients are read.
//     Completing copies (stage 1) or adds (stages 2, 3) the piece into this rank's gradient shard
//     and frees the unit's bucket.
// Stages 0 and 1 keep whole gradients and so reduce once per optimizer step, after the last
// micro-batch (set_reduce(false) for the others); stages 2 and 3 keep only a shard, so they
// reduce each micro-batch's unit into it.
//
// Stage 3 gathers a unit's parameters into a buffer of its own at acquire and frees it at
// release. The model announces the unit it will acquire next (UnitStore::prefetch: forward
// u + 1 after u, backward u - 1 after u, the embedding again after the head when the embeddings
// are tied), and the store starts that all-gather at once, so it travels while the current unit
// computes and acquire usually finds it there (prefetch_stats counts hits and misses). At most
// one prefetched buffer exists beside the held ones; a prefetch that is not acquired next is
// dropped when the next one starts, and any prefetch is dropped before the optimizer writes the
// shard (owned_params), so no gathered copy is ever stale.
//
// optim.step_in_backward (docs/training.md, "The optimizer step inside the backward"): the last
// micro-batch's backward is armed (arm_update), and each unit's gradient is reduced as soon as
// backward has finished it, synchronously, and handed to the update with its parameters; then its
// bucket is freed. Built with hold_grads = false (one micro-batch per step) the store keeps no
// gradient buffer at all: a unit's gradient lives in a bucket from its first unit_grads to its
// grads_done, so at most the embedding's and one more unit's are alive
// (step_in_backward_grad_floats; MemCategory::Gradients at stages 0-1, Communication at stages 2-3,
// whose two-phase step fills the same buckets beside its gradient shard). With accumulation
// (hold_grads) the earlier micro-batches' sum stays where the stage keeps it and the last one adds
// to it, exactly as the two-phase step would. Clipping needs the global norm before the first
// update: arm_norm runs a backward that only measures (each unit's reduced gradient, as the update
// pass will see it, summed as clip_grad_norm sums it) and leaves every buffer as it was.
//
// Memory (floats, Ψ parameters, N ranks, fp32 on the CPU): parameters Ψ (stage 3: Ψ/N),
// gradients Ψ (stages 2, 3: Ψ/N), optimizer state kΨ (stages 1-3: kΨ/N; AdamW k = 2). Unit
// buffers (gathered and prefetched parameters, gradient buckets, reduce-scatter pieces) are
// tagged MemCategory::Communication and live only while a unit is in use or in flight.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "core/allocator.h"
#include "model/unit_store.h"
#include "optim/state_format.h"

namespace memtrain::dist {

// How often stage 3 found a unit already gathered at acquire. Only acquires that need a gather
// count (a unit already held does not).
struct PrefetchStats {
    int64_t hits = 0;     // the unit's prefetch had been started (maybe not finished)
    int64_t misses = 0;   // gathered on the spot
    int64_t dropped = 0;  // prefetched but not acquired next (a wrong hint, or the optimizer step)
};

// How stages 1-3's reduce-scatters completed: arrived means a later unit found the piece there
// (it travelled under compute); the rest were waited for (the in-flight bound, the bucket needed
// again, or the gradients read).
struct ReduceStats {
    int64_t started = 0;
    int64_t arrived = 0;
    std::size_t max_in_flight = 0;  // at most ZeroStore::kMaxReducing
};

class ZeroStore final : public UnitStore {
  public:
    // Reduce-scatters in flight at once (stages 1-3); starting another completes the oldest, so
    // at most this many gradient buckets wait on the network besides the one backward fills.
    static constexpr std::size_t kMaxReducing = 2;

    struct Options {
        // Shards are cut on multiples of `grain` (grain_shard_ranges), so that block-quantized
        // optimizer state keeps every block on one rank (optim/state_format.h: shard_grain).
        int64_t grain = 1;
        // false: no gradient buffer (optim.step_in_backward with one micro-batch per step; every
        // backward must then be armed).
        bool hold_grads = true;
        // optim.master = "none": the parameters are stored in bf16 only, whole on every rank at
        // stages 0-2 and this rank's shard at stage 3. acquire() decodes a unit into an fp32 copy
        // of its own, freed at release (stage 3: this rank's piece decoded into its place of the
        // gathered unit, which the all-gather fills in place, as fp32's gathers do); the updates
        // (step_units, arm_update) decode a chunk of this rank's owned() range, update it in fp32
        // and store it by stochastic rounding drawn from (rounding_seed, the step, the element's
        // global index), so every stage and world size draws the same; at stages 1-2
        // finish_step then broadcasts each rank's piece from its owner.
        bool bf16_params = false;
        uint64_t rounding_seed = 0;
        // With bf16_params: per tensor of the layout, whether the optimizer steps it whole
        // (whole_step_tensors: Muon's matrices, Adafactor's tensors); each is then decoded and
        // updated as one piece, the others a chunk at a time. Empty: none.
        std::vector<char> whole_tensors;
        // With bf16_params: where each element of the layout's flat buffer sits in the whole
        // model's, which its rounding draws from (a tensor-parallel shard's runs, ascending and
        // covering the buffer). Empty: the layout is the whole model's.
        std::vector<IndexRun> global_index;
    };
    ZeroStore(const ParamLayout& layout, Communicator& comm, int stage, Options opts);
    ZeroStore(const ParamLayout& layout, Communicator& comm, int stage)
        : ZeroStore(layout, comm, stage, Options{}) {}
    // Completes whatever is still in flight: MPI writes into the unit buffers until then.
    ~ZeroStore() override;
    ZeroStore(const ZeroStore&) = delete;
    ZeroStore& operator=(const ZeroStore&) = delete;

    int stage() const { return stage_; }
    // The floats of the flat buffer this rank updates: everything at stage 0, its shard else.
    ShardRange owned() const { return owned_; }
    // Every rank's owned(), in rank order.
    const std::vector<ShardRange>& owned_by_rank() const { return owned_by_rank_; }
    // Parameters and (reduced) gradients of owned(), valid after the last micro-batch's backward.
    // The optimizer writes through owned_params(), so it first drops a pending prefetch.
    float* owned_params();
    float* owned_grads();

    // Stages 0 and 1: whether this micro-batch's backward reduces its gradients (true for the
    // last micro-batch of a step). Stages 2 and 3 always reduce. Default true.
    void set_reduce(bool reduce) { reduce_ = reduce; }

    // The global L2 norm of the reduced gradients; when max_norm > 0 and the norm is larger,
    // scales them to max_norm (torch.nn.utils.clip_grad_norm_'s coefficient). A collective.
    double clip_grad_norm(double max_norm);
    // After the optimizer has updated owned_params(): stages 1 and 2 all-gather the parameters so
    // every rank holds them whole again. A collective.
    void finish_step();

    // optim.step_in_backward. The update of the floats [begin, begin + n) of owned(): `params`
    // and `grads` point at them, the gradient reduced and summed over the step's micro-batches
    // (the bits the two-phase step's owned_grads() would hold there). The update may scale
    // `grads` (clipping).
    using UnitUpdate =
        std::function<void(float* params, float* grads, std::size_t begin, std::size_t n)>;
    // The next backward (the step's last micro-batch) updates each unit through `update` as soon
    // as its gradient is reduced. `step`: the update's number (1 for the first), which bf16
    // parameters' stochastic rounding draws from.
    void arm_update(UnitUpdate update, int64_t step);
    // The two-phase step over bf16 parameters: `update` on every unit's owned floats, with the
    // reduced (and clipped) gradients of owned_grads().
    void step_units(const UnitUpdate& update, int64_t step);
    bool bf16_params() const { return bf16_; }
    // The bf16 updates decode, update and round a chunk at a time: at most kRoundChunk floats,
    // cut at its multiples of the flat buffer and at the tensors stepped whole, each of which is
    // one piece. The scratch (round_scratch_floats) is the larger of kRoundChunk, or the largest
    // unit if smaller, and the largest tensor stepped whole.
    static constexpr std::size_t kRoundChunk = std::size_t(1) << 18;
    static std::size_t round_scratch_floats(const ParamLayout& layout,
                                            const std::vector<char>& whole_tensors);
    // The next backward only measures each unit's reduced gradient (the norm pass clipping
    // needs) and changes no buffer the step keeps.
    void arm_norm();
    // Ends an armed backward: the global L2 norm of the gradients it reduced, summed as
    // clip_grad_norm sums them (the same bits). A collective.
    double disarm();

    const PrefetchStats& prefetch_stats() const { return prefetch_stats_; }
    const ReduceStats& reduce_stats() const { return reduce_stats_; }

    // UnitStore
    float* full_params() override;
    float* full_grads() override;
    float* acquire(int u, bool for_write = false) override;
    void release(int u) override;
    void prefetch(int u) override;
    float* unit_grads(int u) override;
    void grads_done(int u) override;
    void zero_grads() override;

  private:
    // One unit's piece of the shard layout: how many of its floats each rank owns, and where
    // this rank's piece starts inside the unit.
    struct UnitShards {
        std::vector<int64_t> counts;  // per rank
        int64_t mine_begin = 0;       // index into the unit of this rank's first float
        int64_t mine_count = 0;
    };
    // A started reduce-scatter of one unit's gradients into this rank's piece.
    struct Reducing {
        int unit = -1;
        uint64_t op = 0;
        Buffer<float> piece;
    };
    // The started all-gather of the unit announced next (stage 3).
    struct Prefetched {
        int unit = -1;  // -1: none
        uint64_t op = 0;
        Buffer<float> params;
    };

    // This rank's shard of unit u's parameters inside params_ (stage 3), or any valid pointer
    // when it owns none of the unit.
    const float* my_piece(int u);
    // Lets started operations advance and completes the reduce-scatters that have arrived.
    void poll();
    // Completes the oldest reduce-scatter: its piece into the gradient shard, its bucket freed.
    void finish_oldest_reduce();
    // Completes the reduce-scatters up to and including unit u's (before its bucket is reused).
    void finish_reduces_of(int u);
    // Completes every started reduction before anyone reads the gradients.
    void sync();
    // Waits for the pending prefetch and frees its buffer.
    void drop_prefetch();
    // An armed grads_done: unit u's gradient reduced now, measured, and updated (arm_update).
    void reduce_armed(int u);
    // The global norm from each unit's sum of squares over this rank's piece: unit by unit, and
    // under stages 1-3 each unit's pieces in rank order (a collective).
    double norm_of(const std::vector<double>& unit_sq);
    // The floats of unit u this rank updates: where they start in owned() and how many.
    std::pair<std::size_t, std::size_t> owned_piece(int u) const;
    // `update` on owned floats [at, at + n) with their gradients g: in place on fp32 parameters;
    // on bf16 ones chunk by chunk (cut at multiples of kRoundChunk of the flat buffer, so no
    // state block is cut), decoded into round_, updated, stored by stochastic rounding.
    void apply_update(const UnitUpdate& update, float* g, std::size_t at, std::size_t n);
    int64_t update_step_ = 0;
    bool bf16_ = false;          // optim.master = "none"
    Buffer<uint16_t> params16_;  // the model in bf16 (stage 3: this rank's shard)
    // The bf16 weight of flat index i (stage 3: i inside this rank's shard).
    uint16_t* bf16_at(std::size_t i) {
        return params16_.data() + (stage_ == 3 ? i - (std::size_t)owned_.offset : i);
    }
    // What this rank sends of unit u in a stage-3 gather into `unit_buf`: its piece of the fp32
    // shard, or (bf16) its piece decoded into its place in unit_buf (gathered in place).
    const float* send_piece(int u, float* unit_buf);
    Buffer<float> round_;  // its update scratch (round_scratch_floats)
    // The tensors stepped whole, as [begin, end) of the flat buffer in increasing order.
    std::vector<std::pair<std::size_t, std::size_t>> whole_;
    uint64_t rounding_seed_ = 0;
    std::vector<IndexRun> global_index_;  // Options::global_index
    // Stores the updated floats w of flat indices [lo, hi) into the bf16 weights, each rounded
    // stochastically with the draw of its global index.
    void round_into(const float* w, std::size_t lo, std::size_t hi);

    enum class Armed { No, Norm, Update };
    Armed armed_ = Armed::No;
    UnitUpdate update_;
    std::vector<double> armed_sq_;  // per unit: the sum of squares of this rank's reduced piece

    const ParamLayout* layout_;
    Communicator* comm_;
    bool in_flight_ = false;  // stage 0: all-reduces started since the last sync
    int stage_;
    ShardRange owned_;
    std::vector<ShardRange> owned_by_rank_;
    std::vector<int64_t> shard_counts_;  // every rank's shard
    std::vector<UnitShards> unit_shards_;
    bool reduce_ = true;

    Buffer<float> params_;  // whole (stages 0-2) or this rank's shard (stage 3)
    Buffer<float> grads_;   // whole (stages 0-1) or this rank's shard (stages 2-3)
    // Stage 3: gathered parameters per unit, with how many acquires hold them and whether one
    // may write. Stages 2-3: a gradient bucket per unit while backward fills it or it is reduced.
    std::vector<Buffer<float>> gathered_;
    std::vector<int> holds_;
    std::vector<bool> written_;
    std::vector<Buffer<float>> buckets_;
    std::deque<Reducing> reducing_;  // oldest first
    ReduceStats reduce_stats_;
    Prefetched prefetched_;
    PrefetchStats prefetch_stats_;
};

}  // namespace memtrain::dist
