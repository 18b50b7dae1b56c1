// The arenas of a training step (see activation_layout.h).
#include "model/activation_layout.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "kernels/cpu/act_int8.h"
#include "model/param_layout.h"

namespace memtrain {

namespace {

// A field's size is its Dim times B*T (times T for the CPU's probabilities).
enum class Dim : uint8_t {
    C,       // n_embd
    Mean,    // 1 for layernorm, 0 for rmsnorm (which keeps no mean)
    One,     // 1
    Qkv,     // qkv_dim()
    Att,     // n_head * T probabilities, or n_head log-sum-exps with fused attention
    Fc,      // fc_dim(): c_fc output
    Hidden,  // mlp_hidden(): the activation output
};
struct FieldInfo {
    const char* name;
    Dim dim;
    bool selective_drops;  // recomputed in backward by the Selective policy
    bool statistic;        // fp32 whatever the activation type
    bool seq_sharded;      // sequence parallelism keeps this rank's ModelConfig::sp_rows only
};
constexpr FieldInfo kFields[kSavedFields] = {
    {"ln_1", Dim::C, true, false, true},
    {"ln_1 mean", Dim::Mean, false, true, true},
    {"ln_1 rstd", Dim::One, false, true, true},
    {"qkv", Dim::Qkv, false, false, false},
    {"attention probabilities", Dim::Att, false, false, false},
    {"attention out", Dim::C, false, false, false},
    {"residual mid", Dim::C, false, false, true},
    {"ln_2", Dim::C, true, false, true},
    {"ln_2 mean", Dim::Mean, false, true, true},
    {"ln_2 rstd", Dim::One, false, true, true},
    {"mlp fc", Dim::Fc, false, false, false},
    {"mlp gelu", Dim::Hidden, true, false, false},
};

const FieldInfo& info(SavedField f) {
    return kFields[static_cast<int>(f)];
}

SavedField field(int i) {
    return static_cast<SavedField>(i);
}

std::size_t aligned(std::size_t bytes, const ActFormat& fmt) {
    return (bytes + fmt.align - 1) / fmt.align * fmt.align;
}

// The scratch holds a field when some block drops it (and it has any bytes); the working block
// of bf16 saved fields holds every field.
bool in_scratch(const RematPlan& plan, SavedField f, const ModelConfig& cfg, const ActFormat& fmt) {
    if (saved_field_bytes(f, cfg, 1, 1, fmt) == 0) return false;
    if (fmt.compressed()) return true;
    for (BlockKeep k : plan)
        if (!keeps(k, f)) return true;
    return false;
}

}  // namespace

const char* keep_name(BlockKeep k) {
    switch (k) {
        case BlockKeep::All:
            return "all";
        case BlockKeep::Selective:
            return "selective";
        case BlockKeep::Input:
            return "input";
        case BlockKeep::Offload:
            return "offload";
        case BlockKeep::Segment:
            return "segment";
        case BlockKeep::Dropped:
            return "dropped";
    }
    return "?";
}

char keep_letter(BlockKeep k) {
    return k == BlockKeep::Segment ? 'g' : keep_name(k)[0];
}

InputRebuild input_rebuild(const RematPlan& plan) {
    const int n = (int)plan.size();
    const bool explicit_holds = !plan.hold_by.empty();
    if (explicit_holds && (int)plan.hold_by.size() != n)
        fail("internal: a remat plan of {} blocks with {} hold entries", n, plan.hold_by.size());
    InputRebuild r;
    r.from.assign(n, -1);
    r.slot.assign(n, -1);
    r.holder.assign(n, -1);
    std::vector<bool> held(n, false), busy;
    int in_use = 0;
    for (int i = n - 1; i >= 0; i--) {
        const auto available = [&](int l) { return !rebuilds_input(plan[l]) || held[l]; };
        if (!available(i)) {
            r.any = true;
            int j = i - 1;
            while (j > 0 && !available(j)) j--;
            if (j < 0 || !available(j))
                fail(
                    "remat plan: block {} rebuilds its input, but no block below keeps one (the "
                    "first block keeps its input)",
                    i);
            r.from[i] = j;
            r.forwards += i - j;
            for (int m = j + 1; m <= i; m++) {
                if (plan[m] != BlockKeep::Segment) continue;
                if (explicit_holds && plan.hold_by[m] != i) continue;  // another rebuild holds it
                int s = 0;
                while (s < (int)busy.size() && busy[s]) s++;
                if (s == (int)busy.size()) busy.push_back(false);
                busy[s] = true;
                held[m] = true;
                r.slot[m] = s;
                r.holder[m] = i;
                in_use++;
            }
            r.slots = std::max(r.slots, in_use);
        }
        if (held[i]) {  // released after the block's backward
            busy[r.slot[i]] = false;
            held[i] = false;
            in_use--;
        }
    }
    for (int l = 0; l < n; l++) {
        if (explicit_holds && plan[l] == BlockKeep::Segment && r.holder[l] != plan.hold_by[l])
            fail(
                "remat plan: block {}'s input is to be held by block {}'s rebuild, which does not "
                "pass it",
                l, plan.hold_by[l]);
        if (explicit_holds && plan[l] != BlockKeep::Segment && plan.hold_by[l] >= 0)
            fail("remat plan: block {} keeps '{}' but names a rebuild to hold its input", l,
                 keep_name(plan[l]));
    }
    r.any = r.any || std::any_of(plan.begin(), plan.end(), rebuilds_input);
    return r;
}

RematPlan slice_plan(const RematPlan& plan, int b0, int b1) {
    if (b0 < 0 || b1 < b0 || b1 > (int)plan.size())
        fail("internal: blocks [{}, {}) of a remat plan of {}", b0, b1, plan.size());
    RematPlan out(plan.begin() + b0, plan.begin() + b1);
    if (plan.hold_by.empty()) return out;
    for (int l = b0; l < b1; l++) {
        const int h = plan.hold_by[l];
        if (h >= 0 && (h < b0 || h >= b1))
            fail(
                "internal: block {}'s input is held by block {}'s rebuild, outside blocks [{}, {})",
                l, h, b0, b1);
        out.hold_by.push_back(h < 0 ? -1 : h - b0);
    }
    return out;
}

void append_plan(RematPlan& whole, const RematPlan& chunk) {
    const int at = (int)whole.size();
    // A plan without hold_by holds by the default rule: input_rebuild's holders spell it out.
    auto holds = [](const RematPlan& p) {
        return p.hold_by.empty() ? input_rebuild(p).holder : p.hold_by;
    };
    if (!whole.hold_by.empty() || !chunk.hold_by.empty()) {
        std::vector<int> h = holds(whole);
        for (int k : holds(chunk)) h.push_back(k < 0 ? -1 : k + at);
        whole.hold_by = std::move(h);
    }
    whole.insert(whole.end(), chunk.begin(), chunk.end());
}

bool keeps(BlockKeep k, SavedField f) {
    return k == BlockKeep::All || (k == BlockKeep::Selective && !info(f).selective_drops);
}

std::string saved_field_name(SavedField f, const ModelConfig& cfg, const ActFormat& fmt) {
    if (f == SavedField::FchAct && cfg.swiglu()) return "mlp swiglu";
    if (f == SavedField::Att && fmt.fused_attention) return "attention log-sum-exp";
    return info(f).name;
}

namespace {

// Products and sums of the layout's sizes, checked: the config's bounds allow shapes (a huge
// batch of long sequences with many heads) whose T^2 attention bytes pass 2^64; such a plan is
// an error, never a wrapped size and an arena too small.
std::size_t layout_mul(std::size_t a, std::size_t b) {
    std::size_t r = 0;
    if (__builtin_mul_overflow(a, b, &r))
        fail("the activations of this model and batch do not fit in 64 bits ({} x {} bytes)", a, b);
    return r;
}

std::size_t layout_add(std::size_t a, std::size_t b) {
    std::size_t r = 0;
    if (__builtin_add_overflow(a, b, &r))
        fail("the activations of this model and batch do not fit in 64 bits");
    return r;
}

}  // namespace

std::size_t saved_field_bytes(SavedField f, const ModelConfig& cfg, int B, int T,
                              const ActFormat& fmt) {
    // The rows this rank keeps: its sequence shard for the norm regions under sequence
    // parallelism, every token row otherwise.
    const std::size_t BT =
        info(f).seq_sharded ? (std::size_t)cfg.sp_rows((int64_t)B * T) : (std::size_t)B * T;
    std::size_t n = 0;
    bool stat = info(f).statistic;
    switch (info(f).dim) {
        case Dim::C:  // the attention output is its heads' width (C / tp on a TP shard)
            n = layout_mul(BT, f == SavedField::Atty ? cfg.attn_dim() : cfg.n_embd);
            break;
        case Dim::Mean:
            n = cfg.rmsnorm() ? 0 : BT;
            break;
        case Dim::One:
            n = BT;
            break;
        case Dim::Qkv:
            n = layout_mul(BT, cfg.local_qkv_dim());
            break;
        case Dim::Att:
            n = layout_mul(layout_mul(BT, cfg.local_heads()),
                           fmt.fused_attention ? 1 : (std::size_t)T);
            stat = stat || fmt.fused_attention;
            break;
        case Dim::Fc:
            n = layout_mul(BT, cfg.local_fc_dim());
            break;
        case Dim::Hidden:
            n = layout_mul(BT, cfg.local_hidden());
            break;
    }
    if (!stat && fmt.saved == SavedStore::int8) return cpu::int8_store_bytes(n);
    return layout_mul(n, stat                            ? sizeof(float)
                         : fmt.saved == SavedStore::bf16 ? 2
                                                         : (std::size_t)fmt.elem_bytes);
}

std::size_t scratch_field_bytes(SavedField f, const ModelConfig& cfg, int B, int T,
                                const ActFormat& fmt) {
    ActFormat work = fmt;  // the scratch (or working block) is fp32
    work.saved = SavedStore::fp32;
    // ActFormat::mlp_tile makes both norms' outputs, c_fc's output and the activation one tile of
    // token rows at a time: the scratch holds a tile of them.
    if (is_tiled_field(f) && fmt.mlp_tile > 0 && (int64_t)fmt.mlp_tile < (int64_t)B * T)
        return saved_field_bytes(f, cfg, 1, fmt.mlp_tile, work);
    return saved_field_bytes(f, cfg, B, T, work);
}

bool is_tiled_field(SavedField f) {
    return f == SavedField::Ln1 || f == SavedField::Ln2 || info(f).dim == Dim::Fc ||
           info(f).dim == Dim::Hidden;
}

bool is_statistic(SavedField f, const ActFormat& fmt) {
    return info(f).statistic || (info(f).dim == Dim::Att && fmt.fused_attention);
}

std::size_t kept_bytes(const ModelConfig& cfg, int B, int T, BlockKeep k, const ActFormat& fmt) {
    std::size_t n = 0;
    for (int i = 0; i < kSavedFields; i++)
        if (keeps(k, field(i)))
            n = layout_add(n, aligned(saved_field_bytes(field(i), cfg, B, T, fmt), fmt));
    return n;
}

std::size_t scratch_bytes(const ModelConfig& cfg, int B, int T, BlockKeep k, const ActFormat& fmt) {
    // bf16 saved fields: the fp32 working block holds every field, whatever the block keeps.
    std::size_t n = 0;
    for (int i = 0; i < kSavedFields; i++)
        if (fmt.compressed() || !keeps(k, field(i)))
            n = layout_add(n, aligned(scratch_field_bytes(field(i), cfg, B, T, fmt), fmt));
    return n;
}

std::size_t resid_bytes(const ModelConfig& cfg, int B, int T, const ActFormat& fmt) {
    return aligned((std::size_t)cfg.sp_rows((int64_t)B * T) * cfg.n_embd * fmt.elem_bytes, fmt);
}

std::size_t fixed_bytes(const ModelConfig& cfg, int B, int T, const ActFormat& fmt) {
    const std::size_t BT = (std::size_t)cfg.sp_rows((int64_t)B * T), C = cfg.n_embd,
                      e = fmt.elem_bytes;
    const std::size_t stream = aligned(layout_mul(layout_mul(BT, C), e), fmt);
    return layout_add(
        layout_add(layout_mul(stream, cfg.n_layer + 1), stream),
        layout_mul(cfg.rmsnorm() ? 1 : 2, aligned(layout_mul(BT, sizeof(float)), fmt)));
}

std::size_t bf16_gemm_elems(const ModelConfig& cfg, int64_t BT, int chunk) {
    const std::size_t N = (std::size_t)BT, C = cfg.n_embd;
    // (in, out) of c_attn, attn.c_proj, c_fc and mlp.c_proj on this rank.
    const std::size_t linears[4][2] = {{C, (std::size_t)cfg.local_qkv_dim()},
                                       {(std::size_t)cfg.attn_dim(), C},
                                       {C, (std::size_t)cfg.local_fc_dim()},
                                       {(std::size_t)cfg.local_hidden(), C}};
    std::size_t most = 0;
    for (const auto& io : linears) {
        const std::size_t in = io[0], out = io[1];
        most = std::max({most, N * in + in * out, N * out + std::max(in * out, N * in)});
    }
    const std::size_t rows = std::min<std::size_t>(chunk, N), V = cfg.local_vocab();
    return std::max(most, V * C + rows * (C + V));
}

std::size_t cuda_kernel_scratch_bytes(const ModelConfig& cfg, int B, int T) {
    // The fixed-order reductions keep fp32 partial sums per 64-row chunk and column (the norm
    // backward two such tables, the bias gradients one), and double partial sums per 2^16
    // elements for the gradient norm (the whole parameter buffer) and the loss (B*T rows).
    const std::size_t N = (std::size_t)B * T;
    const std::size_t widest = std::max<std::size_t>(
        {(std::size_t)cfg.n_embd, (std::size_t)cfg.qkv_dim(), (std::size_t)cfg.fc_dim()});
    const std::size_t chunks = (N + 63) / 64;
    const std::size_t columns = 2 * chunks * widest * sizeof(float);
    const std::size_t psi = make_param_layout(cfg).total;
    const std::size_t sums = ((psi >> 16) + (N >> 16) + 4) * sizeof(double);
    constexpr std::size_t kMiB = std::size_t{1} << 20;  // device_scratch grows in whole MiB
    return (std::max(columns, sums) + kMiB - 1) / kMiB * kMiB;
}

ActFormat cuda_arena_format(const ModelConfig& cfg, int elem_bytes, int B, int T) {
    constexpr std::size_t kLogitsBytes = std::size_t{256} << 20;
    const std::size_t row = (std::size_t)cfg.padded_vocab() * elem_bytes;
    const int chunk = (int)std::max<std::size_t>(64, kLogitsBytes / row / 64 * 64);
    return ActFormat::cuda_model(elem_bytes, std::min(chunk, B * T));
}

ArenaPlan plan_arena(const ModelConfig& cfg, int B, int T, const RematPlan& plan_in,
                     const ActFormat& fmt) {
    // BT token rows pass through the tensor-parallel regions; the residual stream, the norms and
    // d(residual) hold NS of them (NS = BT / tp under sequence parallelism).
    const std::size_t BT = (std::size_t)B * T, NS = (std::size_t)cfg.sp_rows((int64_t)BT);
    const std::size_t C = cfg.n_embd, L = cfg.n_layer;
    const std::size_t e = fmt.elem_bytes, f32 = sizeof(float);
    const auto A = MemCategory::Activations, W = MemCategory::Workspace;
    const RematPlan plan = plan_in.empty() ? RematPlan(L, BlockKeep::All) : plan_in;
    if (plan.size() != L)
        fail("remat plan has {} entries but model.n_layer is {}", plan.size(), cfg.n_layer);
    const std::size_t offloaded = std::count(plan.begin(), plan.end(), BlockKeep::Offload);
    const InputRebuild rebuild = input_rebuild(plan);
    if (offloaded > 0 && rebuild.any)
        fail("internal: a remat plan that both offloads and rebuilds block inputs");
    ArenaPlan p;
    std::size_t act = 0, work = 0;
    auto take_act = [&](std::size_t bytes) {
        std::size_t at = act;
        act = layout_add(act, aligned(bytes, fmt));
        return at;
    };
    auto take_work = [&](std::size_t bytes) {
        std::size_t at = work;
        work = layout_add(work, aligned(bytes, fmt));
        return at;
    };

    // Activation arena, in the order the CPU model has always carved it: residual streams, each
    // field for every block that keeps it, ln_f, then the shared recompute scratch.
    if (rebuild.any) {
        // Kept inputs and the last stream their own; rebuilt inputs two temporaries (by parity,
        // so a block's input and output never share one) and the hold slots.
        const std::size_t temp[2] = {take_act(NS * C * e), take_act(NS * C * e)};
        std::size_t kept = 1;
        for (std::size_t l = 0; l < L; l++) {
            kept += !rebuilds_input(plan[l]);
            p.resid.push_back(rebuilds_input(plan[l]) ? temp[l % 2] : take_act(NS * C * e));
        }
        p.resid.push_back(take_act(NS * C * e));
        for (int s = 0; s < rebuild.slots; s++) p.held.push_back(take_act(NS * C * e));
        p.entries.push_back(
            {fmt::format("residual stream: {} kept + 2 temporaries + {} held for {} rebuilt inputs",
                         kept, rebuild.slots, L + 1 - kept),
             act, A});
    } else if (offloaded == 0) {
        for (std::size_t l = 0; l <= L; l++) p.resid.push_back(take_act(NS * C * e));
        p.entries.push_back({"residual stream x n_layer+1", act, A});
    } else {
        // The inputs of Offload blocks share a ring of slots (the i-th such block, in order, slot
        // i % slots); every other block's input, and the last stream, keep their own.
        const std::size_t slots = std::min<std::size_t>(offloaded, kOffloadSlots);
        std::vector<std::size_t> ring;
        for (std::size_t k = 0; k < slots; k++) ring.push_back(take_act(NS * C * e));
        std::size_t i = 0;
        for (std::size_t l = 0; l < L; l++)
            p.resid.push_back(plan[l] == BlockKeep::Offload ? ring[i++ % slots]
                                                            : take_act(NS * C * e));
        p.resid.push_back(take_act(NS * C * e));
        p.offloaded_bytes = (offloaded - slots) * NS * C * e;
        p.entries.push_back(
            {offloaded == L
                 ? fmt::format("residual stream: {} ring slots + the last (inputs in host memory)",
                               slots)
                 : fmt::format("residual stream: {} kept + {} ring slots for {} offloaded inputs",
                               L + 1 - offloaded, slots, offloaded),
             act, A});
    }
    p.block.assign(L, {});
    for (auto& b : p.block) b.fill(kNoOffset);
    for (int i = 0; i < kSavedFields; i++) {
        const std::size_t bytes = saved_field_bytes(field(i), cfg, B, T, fmt);
        if (bytes == 0) continue;
        std::size_t n = 0, start = act;
        for (std::size_t l = 0; l < L; l++)
            if (keeps(plan[l], field(i))) {
                p.block[l][i] = take_act(bytes);
                n++;
            }
        if (n > 0)
            p.entries.push_back(
                {fmt::format("{} x {} blocks", saved_field_name(field(i), cfg, fmt), n),
                 act - start, A});
    }
    {
        const std::size_t start = act;
        p.lnf = take_act(NS * C * e);
        if (!cfg.rmsnorm()) p.lnf_mean = take_act(NS * f32);
        p.lnf_rstd = take_act(NS * f32);
        p.entries.push_back(
            {cfg.rmsnorm() ? "ln_f (+ rstd)" : "ln_f (+ mean, rstd)", act - start, A});
    }
    {
        std::string names;
        const std::size_t start = act;
        p.work.fill(kNoOffset);
        for (int i = 0; i < kSavedFields; i++) {
            if (!in_scratch(plan, field(i), cfg, fmt)) continue;
            const std::size_t at = take_act(scratch_field_bytes(field(i), cfg, B, T, fmt));
            if (fmt.compressed())
                p.work[i] = at;
            else
                for (std::size_t l = 0; l < L; l++)
                    if (!keeps(plan[l], field(i))) p.block[l][i] = at;
            names += (names.empty() ? "" : ", ") + saved_field_name(field(i), cfg, fmt);
        }
        if (act > start)
            p.entries.push_back(
                {(fmt.compressed() ? "working block, fp32, one block ("
                                   : "recompute scratch, one block (") +
                     names +
                     (fmt.mlp_tile > 0 && (int64_t)fmt.mlp_tile < (int64_t)BT
                          ? fmt::format("; the norms' and the MLP's in tiles of {} rows",
                                        fmt.mlp_tile)
                          : std::string()) +
                     ")",
                 act - start, A});
    }
    p.activation_bytes = act;

    // Workspace arena.
    p.dres = take_work(NS * C * e);
    p.entries.push_back({"d residual", NS * C * e, W});
    p.dln = take_work(BT * C * e);
    p.entries.push_back({"d layernorm input", BT * C * e, W});
    // One buffer for d(qkv) and d(c_fc output); SwiGLU also needs d(product) beside d(fch). The
    // tiled MLP's backward holds a tile of rows of the MLP's.
    const std::size_t mlp_rows =
        fmt.mlp_tile > 0 ? std::min<std::size_t>(fmt.mlp_tile, BT) : (std::size_t)BT;
    const std::size_t big = std::max(BT * (std::size_t)cfg.local_qkv_dim(),
                                     mlp_rows * (std::size_t)cfg.local_fc_dim()) *
                            e;
    p.dbig = take_work(big);
    p.entries.push_back({"d qkv / d mlp hidden", big, W});
    if (cfg.swiglu()) {
        const std::size_t dact = mlp_rows * cfg.local_hidden() * e;
        p.dact = take_work(dact);
        p.entries.push_back({"d mlp product", dact, W});
    }
    const std::size_t logits = std::min<std::size_t>(fmt.loss_chunk, BT) * cfg.local_vocab() * e;
    p.logits = take_work(logits);
    p.entries.push_back({"logits chunk", logits, W});
    if (fmt.bf16_gemm) {
        const std::size_t b = bf16_gemm_elems(cfg, (int64_t)BT, fmt.loss_chunk) * 2;
        p.gemm_bf16 = take_work(b);
        p.entries.push_back({"bf16 GEMM operands (one GEMM's)", b, W});
    }
    if (NS != BT) {
        // Sequence parallelism: the all-gathered norm output (or d(output)) a tensor-parallel
        // GEMM reads, and a row-parallel GEMM's partial output before its reduce-scatter.
        p.sp_gather = take_work(BT * C * e);
        p.entries.push_back({"sequence-parallel gather (all token rows)", BT * C * e, W});
    }
    if (fmt.cuda) {
        p.row_loss = take_work(BT * f32);
        p.entries.push_back({"per-token losses", BT * f32, W});
        p.att_delta = take_work(BT * cfg.n_head * f32);
        p.entries.push_back({"attention backward delta", BT * cfg.n_head * f32, W});
    }
    // Report the padded sizes, so the arena's entries add up to what is allocated.
    for (auto& entry : p.entries)
        if (entry.category == W) entry.bytes = aligned(entry.bytes, fmt);
    p.workspace_bytes = work;
    if (fmt.cuda) {
        // Process-wide allocations beside the arena (kernels/cuda): the kernels' scratch, which
        // grows in whole MiB, and cuBLASLt's workspace.
        p.entries.push_back(
            {"kernel scratch (fixed-order partial sums)", cuda_kernel_scratch_bytes(cfg, B, T), W});
        p.entries.push_back({"cuBLASLt workspace", kCublasWorkspaceBytes, W});
    }
    return p;
}

ArenaPlan plan_stage_arena(const ModelConfig& cfg, int blocks, int B, int T, const RematPlan& plan,
                           const ActFormat& fmt) {
    ModelConfig stage = cfg;
    stage.n_layer = blocks;
    return plan_arena(stage, B, T, plan, fmt);
}

std::size_t split_backward_floats(const ModelConfig& cfg, int B, int T) {
    // d(mlp c_proj out) and d(attn c_proj out) (C each), d(c_fc out), d(qkv): this rank's share.
    return (std::size_t)B * T * (2 * cfg.n_embd + cfg.local_fc_dim() + cfg.local_qkv_dim());
}

std::size_t split_backward_bytes(const ModelConfig& cfg, int blocks, int B, int T) {
    return sizeof(float) * split_backward_floats(cfg, B, T) * blocks;
}

std::vector<ArenaEntry> activation_layout(const ModelConfig& cfg, int B, int T,
                                          const RematPlan& plan, const ActFormat& fmt) {
    return plan_arena(cfg, B, T, plan, fmt).entries;
}

std::size_t arena_bytes(const std::vector<ArenaEntry>& layout, MemCategory c) {
    std::size_t n = 0;
    for (const auto& e : layout)
        if (e.category == c) n += e.bytes;
    return n;
}

}  // namespace memtrain
