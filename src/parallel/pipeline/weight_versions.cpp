// A pipeline stage's weight versions: none, PipeDream's stash, 2BW's shadow (see
// weight_versions.h).
#include "parallel/pipeline/weight_versions.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain::pp {

std::size_t weight_version_floats(Kind kind, int p, int stage, std::size_t count,
                                  std::size_t mirror_count) {
    if (kind == Kind::PipeDream) return (std::size_t)(pipedream_versions(p, stage) - 1) * count;
    if (kind == Kind::PipeDream2BW) return count + mirror_count;
    return 0;
}

std::string weight_version_formula(Kind kind, int p, int stage) {
    if (kind == Kind::PipeDream) {
        const int n = pipedream_versions(p, stage) - 1;
        return fmt::format(" + {} stashed weight version{} (PipeDream: p - s - 1)", n,
                           n == 1 ? "" : "s");
    }
    if (kind == Kind::PipeDream2BW) return " + the shadow W(t - 1) (PipeDream-2BW)";
    return "";
}

WeightVersions::WeightVersions(StageWeights w, std::function<int64_t()> version)
    : w_(w), version_(std::move(version)) {}

void WeightVersions::begin_step(int /*m*/) {
    used_.clear();
}

std::size_t WeightVersions::bytes() const {
    std::size_t b = 0;
    for (const Buffer<float>& x : copies_) b += x.size() * sizeof(float);
    return b;
}

uint64_t WeightVersions::weights_hash() const {
    // FNV-1a over the bits of the owned range.
    uint64_t h = 1469598103934665603ull;
    const auto* b = reinterpret_cast<const unsigned char*>(w_.params);
    for (std::size_t k = 0; k < w_.count * sizeof(float); k++) h = (h ^ b[k]) * 1099511628211ull;
    return h;
}

namespace {

class PipeDreamStash final : public WeightVersions {
  public:
    PipeDreamStash(int p, int stage, StageWeights w, std::function<int64_t()> version)
        : WeightVersions(w, std::move(version)), p_(p), stage_(stage) {
        // RunConfig refuses a tied model, so there is no mirror to stash.
        const int copies = pipedream_versions(p, stage) - 1;
        for (int k = 0; k < copies; k++) copies_.emplace_back(w_.count, MemCategory::Parameters);
        stash_version_.assign((std::size_t)copies, -1);
    }
    void begin_step(int m) override {
        used_.assign((std::size_t)m, VersionUse{});
        where_.assign((std::size_t)m, -1);
        stash_users_.assign(copies_.size(), 0);
        weight_users_ = 0;
    }
    void forward(int i) override {
        used_[i].forward = version();
        weight_users_++;
        if (hash_) used_[i].forward_hash = weights_hash();
    }
    float backward(int i, const std::function<float()>& run) override {
        // Restore the forward's version, backward (micro-batch i's gradient alone, as a step of
        // one micro-batch) and put the newest weights back; the update follows once d(input) is
        // on its way.
        float* params = w_.params;
        const std::size_t n = w_.count;
        const int k = where_[(std::size_t)i];
        if (k >= 0) std::swap_ranges(params, params + n, copies_[k].data());
        used_[i].backward = k >= 0 ? stash_version_[k] : version();
        if (hash_) used_[i].backward_hash = weights_hash();
        const float loss = run();
        if (k >= 0) {
            std::swap_ranges(params, params + n, copies_[k].data());
            if (--stash_users_[k] == 0) stash_version_[k] = -1;
        } else {
            weight_users_--;
        }
        return loss;
    }
    bool update_per_micro_batch() const override { return true; }
    void before_micro_batch_update(int i) override {
        // The newest weights stashed first if a micro-batch in flight still needs them.
        if (weight_users_ > 0) {
            const auto free = std::find(stash_version_.begin(), stash_version_.end(), -1);
            if (free == stash_version_.end())
                fail("internal: PipeDream stage {} needs more than {} weight versions", stage_,
                     pipedream_versions(p_, stage_));
            const int k = (int)(free - stash_version_.begin());
            std::copy(w_.params, w_.params + w_.count, copies_[k].data());
            stash_version_[k] = version();
            stash_users_[k] = weight_users_;
            for (std::size_t j = 0; j < used_.size(); j++)
                if (where_[j] == -1 && used_[j].forward >= 0 && used_[j].backward < 0 &&
                    (int)j != i)
                    where_[j] = k;
            weight_users_ = 0;
        }
        int live = 1;
        for (int64_t v : stash_version_) live += v >= 0;
        peak_live_ = std::max(peak_live_, live);
    }
    std::size_t predicted_bytes() const override {
        return sizeof(float) * weight_version_floats(Kind::PipeDream, p_, stage_, w_.count, 0);
    }
    std::string summary() const override {
        return fmt::format(
            "weight versions: stage {} keeps up to p - s = {} (the weights and {} stash "
            "buffer{}, {:.1f} MiB); most alive at once so far: {}; {} updates applied (one per "
            "micro-batch)\n",
            stage_, pipedream_versions(p_, stage_), copies_.size(), copies_.size() == 1 ? "" : "s",
            bytes() / 1048576.0, peak_live_, version());
    }

  private:
    int p_, stage_;
    std::vector<int64_t> stash_version_;  // the version each stash buffer holds, -1 free
    // This step: where each micro-batch in flight finds the weights its forward ran on (-1: the
    // weights themselves, k: stash buffer k), and how many in-flight micro-batches use the
    // weights and each stash buffer.
    std::vector<int> where_, stash_users_;
    int weight_users_ = 0;
};

class TwoBwShadow final : public WeightVersions {
  public:
    TwoBwShadow(StageWeights w, std::function<int64_t()> version)
        : WeightVersions(w, std::move(version)) {
        // One shadow of everything the stage computes with: the owned range, then the mirror.
        copies_.emplace_back(w_.count + w_.mirror_count, MemCategory::Parameters);
    }
    void begin_step(int m) override {
        used_.assign((std::size_t)m, VersionUse{});
        if (!valid_) {  // W(-1) = W(0), and after a resume the loaded weights
            save();
            valid_ = true;
        }
        swap();  // the whole step on the shadow
        peak_live_ = 2;
    }
    void forward(int i) override {
        used_[i].forward = shadow_version_;
        if (hash_) used_[i].forward_hash = weights_hash();
    }
    float backward(int i, const std::function<float()>& run) override {
        used_[i].backward = shadow_version_;
        if (hash_) used_[i].backward_hash = weights_hash();
        return run();
    }
    // The newest weights back; the shadow keeps W(t - 1).
    void end_step() override { swap(); }
    // The shadow becomes W(t); the update takes the weights to W(t + 1).
    void before_update() override { save(); }
    void weights_loaded() override { valid_ = false; }
    std::size_t predicted_bytes() const override {
        return sizeof(float) *
               weight_version_floats(Kind::PipeDream2BW, 2, 0, w_.count, w_.mirror_count);
    }
    std::string summary() const override {
        return fmt::format(
            "weight versions: the weights and the shadow W(t - 1) ({:.1f} MiB) every step "
            "computes on; {} updates applied\n",
            bytes() / 1048576.0, version());
    }

  private:
    // Exchanges the parameters (and the mirror) with the shadow.
    void swap() {
        float* sh = copies_[0].data();
        std::swap_ranges(w_.params, w_.params + w_.count, sh);
        if (w_.mirror_count)
            std::swap_ranges(w_.mirror, w_.mirror + w_.mirror_count, sh + w_.count);
    }
    // Copies them into it, the shadow then being the current version.
    void save() {
        float* sh = copies_[0].data();
        std::copy(w_.params, w_.params + w_.count, sh);
        if (w_.mirror_count) std::copy(w_.mirror, w_.mirror + w_.mirror_count, sh + w_.count);
        shadow_version_ = version();
    }
    bool valid_ = false;
    int64_t shadow_version_ = 0;
};

class Synchronous final : public WeightVersions {
  public:
    using WeightVersions::WeightVersions;
};

}  // namespace

std::unique_ptr<WeightVersions> make_weight_versions(Kind kind, int p, int stage, int chunks,
                                                     StageWeights w,
                                                     std::function<int64_t()> version) {
    if ((kind == Kind::PipeDream || kind == Kind::PipeDream2BW) && chunks > 1)
        fail("internal: {} with {} chunks per rank", kind_name(kind), chunks);
    if (kind == Kind::PipeDream)
        return std::make_unique<PipeDreamStash>(p, stage, w, std::move(version));
    if (kind == Kind::PipeDream2BW) return std::make_unique<TwoBwShadow>(w, std::move(version));
    return std::make_unique<Synchronous>(w, std::move(version));
}

}  // namespace memtrain::pp
