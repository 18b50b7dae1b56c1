// Checkpoint writing and reading on top of the safetensors reader and writer.
#include "io/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/regular_file.h"
#include "data/tokenizer.h"
#include "io/hf_weights.h"
#include "io/out_dir.h"
#include "io/safetensors.h"
#include "io/text_file.h"

namespace fs = std::filesystem;

namespace memtrain {

namespace {

const std::string& meta(const io::SafetensorsFile& f, const std::string& key,
                        const std::string& path) {
    auto it = f.metadata().find(key);
    if (it == f.metadata().end())
        fail("{}: training state has no '{}' entry in its metadata", path, key);
    return it->second;
}

uint64_t meta_u64(const io::SafetensorsFile& f, const std::string& key, const std::string& path) {
    const std::string& v = meta(f, key, path);
    try {
        std::size_t used = 0;
        uint64_t x = std::stoull(v, &used, 0);
        if (used != v.size()) throw std::invalid_argument(v);
        return x;
    } catch (const std::exception&) {
        fail("{}: metadata '{}' = '{}' is not an unsigned integer", path, key, v);
    }
}

// A finite number, or a failure naming the key; `what` says what else it must be ("positive").
double meta_number(const io::SafetensorsFile& f, const std::string& key, const std::string& path,
                   const char* what, bool (*ok)(double)) {
    const std::string& v = meta(f, key, path);
    double x = 0;
    try {
        x = std::stod(v);
    } catch (const std::exception&) {
        fail("{}: metadata '{}' = '{}' is not a number", path, key, v);
    }
    if (!std::isfinite(x) || !ok(x))
        fail("{}: metadata '{}' = '{}' is not a {} number", path, key, v, what);
    return x;
}

}  // namespace

namespace {

std::string optimizer_file(int index, int count) {
    return fmt::format("optimizer.{:05d}-of-{:05d}.safetensors", index, count);
}

// std::filesystem throws its own exception type; a failed rename is bad input for a person
// (a full disk, a permission), not an internal error.
void rename_or_fail(const fs::path& from, const fs::path& to) {
    std::error_code ec;
    fs::rename(from, to, ec);
    if (ec) fail("cannot rename {} to {}: {}", from.string(), to.string(), ec.message());
}

// How many of the n values at p are not finite (the exponent bits all set), for the dtypes
// that hold weights; SIZE_MAX for others.
std::size_t count_non_finite(const unsigned char* p, std::size_t n, io::DType dtype) {
    std::size_t bad = 0;
    switch (dtype) {
        case io::DType::F32:
            for (std::size_t i = 0; i < n; i++) {
                uint32_t b;
                std::memcpy(&b, p + 4 * i, 4);
                bad += (b & 0x7f800000u) == 0x7f800000u;
            }
            return bad;
        case io::DType::BF16:
        case io::DType::F16: {
            const uint16_t mask = dtype == io::DType::BF16 ? 0x7f80 : 0x7c00;
            for (std::size_t i = 0; i < n; i++) {
                uint16_t h;
                std::memcpy(&h, p + 2 * i, 2);
                bad += (h & mask) == mask;
            }
            return bad;
        }
        default:
            return SIZE_MAX;
    }
}

// The first tensor of the checkpoint files in `dir` (weights, adapters, optimizer state) that
// holds a value that is not finite, described for the error; "" when every value is finite.
// One pass over what was just written, read back through the page cache a window at a time:
// each window's pages leave the process's resident set once counted, so the check adds a few
// MiB to the peak RSS, not the size of the optimizer state (the demo's peak was its checkpoint's
// read-back).
std::string first_non_finite(const fs::path& dir) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir)) {
        const std::string name = e.path().filename().string();
        if (name.ends_with(".safetensors") && name != "training_state.safetensors")
            files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());  // model.safetensors before optimizer.*
    for (const auto& f : files) {
        const auto st = io::SafetensorsFile::open(f.string());
        for (const auto& t : st.tensors()) {
            const auto* p = static_cast<const unsigned char*>(st.data(t));
            const uint64_t bytes = t.end - t.begin;
            const uint64_t esize = std::max<uint64_t>(1, t.numel > 0 ? bytes / t.numel : 1);
            const uint64_t window = std::max<uint64_t>(1, (uint64_t{4} << 20) / esize) * esize;
            std::size_t bad = 0;
            for (uint64_t at = 0; at < bytes; at += window) {
                const uint64_t n = std::min(window, bytes - at);
                const std::size_t k = count_non_finite(p + at, (std::size_t)(n / esize), t.dtype);
                st.release_pages(t, at, n);
                if (k == SIZE_MAX) {  // not a dtype that holds weights
                    bad = SIZE_MAX;
                    break;
                }
                bad += k;
            }
            if (bad != SIZE_MAX && bad > 0)
                return fmt::format("tensor '{}' of {} holds {} non-finite values of {}", t.name,
                                   f.filename().string(), bad, t.numel);
        }
    }
    return "";
}

void write_checkpoint_files(const fs::path& tmp_dir, const RunConfig& cfg,
                            const CheckpointModel& weights, OptimizerState& opt,
                            const TrainState& state, dist::Communicator& comm);

// Whether a checkpoint directory holds every file a resume reads first.
bool complete_checkpoint(const fs::path& d) {
    std::error_code ec;
    return fs::is_directory(d, ec) &&
           (fs::exists(d / "model.safetensors", ec) ||
            fs::exists(d / "adapter_model.safetensors", ec)) &&
           fs::exists(d / "training_state.safetensors", ec) && fs::exists(d / "memtrain.toml", ec);
}

// The complete ckpt_* of `dir` with the highest step, or "".
std::string newest_complete_checkpoint(const fs::path& dir) {
    std::string best;
    uint64_t best_step = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
        const std::string name = e.path().filename().string();
        if (!io::is_checkpoint_name(name) || name.size() > 25 || !complete_checkpoint(e.path()))
            continue;
        const uint64_t step = std::stoull(name.substr(5));
        if (best.empty() || step > best_step) best = name, best_step = step;
    }
    return best;
}

}  // namespace

void save_hf_weights(GPT& model, const std::string& path, bool write) {
    save_hf_weights(model.weights(), path, write);
}

void load_hf_weights(GPT& model, const std::string& path) {
    load_hf_weights(model.weights(), path);
}

std::string save_checkpoint(const std::string& out_dir, const RunConfig& cfg, GPT& model,
                            Optimizer& opt, const TrainState& state) {
    dist::LocalCommunicator local;
    return save_checkpoint(out_dir, cfg, model.weights(), opt, state, local);
}

TrainState load_checkpoint(const std::string& dir, GPT& model, Optimizer& opt) {
    return load_checkpoint(dir, model.weights(), opt);
}

CheckpointModel hf_checkpoint_model(const ModelWeights& weights) {
    return {weights.cfg, weights.layout,
            [weights](const std::string& dir, bool root) {
                save_hf_weights(weights, (fs::path(dir) / "model.safetensors").string(), root);
            },
            [weights](const std::string& dir) {
                load_hf_weights(weights, (fs::path(dir) / "model.safetensors").string());
            }};
}

std::string save_checkpoint(const std::string& out_dir, const RunConfig& cfg,
                            const ModelWeights& weights, OptimizerState& opt,
                            const TrainState& state, dist::Communicator& comm) {
    return save_checkpoint(out_dir, cfg, hf_checkpoint_model(weights), opt, state, comm);
}

TrainState load_checkpoint(const std::string& dir, const ModelWeights& weights,
                           OptimizerState& opt) {
    return load_checkpoint(dir, hf_checkpoint_model(weights), opt);
}

std::string save_checkpoint(const std::string& out_dir, const RunConfig& cfg,
                            const CheckpointModel& weights, OptimizerState& opt,
                            const TrainState& state, dist::Communicator& comm) {
    const bool root = comm.rank() == 0;
    std::string name = fmt::format("ckpt_{:06d}", state.step);
    // Rank 0's process id names this save's temporaries: a second writer (which the out_dir's
    // lock should have stopped) never deletes or fills this one's.
    int64_t owner = root ? (int64_t)::getpid() : 0;
    if (comm.size() > 1) comm.all_reduce_max(&owner, 1);
    const fs::path out(out_dir);
    fs::path final_dir = out / name;
    fs::path tmp_dir = out / fmt::format(".{}.tmp.{}", name, owner);
    if (root) {
        std::error_code ec;
        fs::create_directories(out, ec);
        fs::remove_all(tmp_dir, ec);
        fs::create_directories(tmp_dir, ec);
        if (ec) fail("cannot create {}: {}", tmp_dir.string(), ec.message());
    }
    comm.barrier();  // the directory exists for every rank (out_dir is on a shared file system)

    try {
        write_checkpoint_files(tmp_dir, cfg, weights, opt, state, comm);
    } catch (...) {
        // A failed save (a full disk) leaves nothing behind on the disk it failed on.
        std::error_code ec;
        if (root) fs::remove_all(tmp_dir, ec);
        throw;
    }
    comm.barrier();  // every rank's files are complete

    // Never a checkpoint of a diverged model: one that resumes into NaN at once would become
    // `latest` and every resume would fail. Rank 0 reads back what was written.
    std::string bad;
    if (root) {
        try {
            bad = first_non_finite(tmp_dir);
        } catch (...) {
            std::error_code ec;
            fs::remove_all(tmp_dir, ec);
            throw;
        }
        if (!bad.empty()) {
            std::error_code ec;
            fs::remove_all(tmp_dir, ec);
        }
    }
    int64_t refused = bad.empty() ? 0 : 1;
    if (comm.size() > 1) comm.all_reduce_max(&refused, 1);
    if (refused)
        fail(
            "not saving {} at step {}: {} (training diverged); `latest` still names the last "
            "good checkpoint. Lower optim.lr or check the data",
            name, state.step, root ? bad : std::string("rank 0 found non-finite values"));

    if (root) {
        // Swap into place: the old directory of the same step (if any) goes only after the new
        // one is complete. Each rename is followed by an fsync of out_dir, so after a power cut
        // `latest` names a directory that is there (or the previous one).
        io::sync_directory(tmp_dir);
        fs::path old_dir = out / fmt::format(".{}.old.{}", name, owner);
        std::error_code ec;
        fs::remove_all(old_dir, ec);
        if (fs::exists(final_dir, ec)) rename_or_fail(final_dir, old_dir);
        rename_or_fail(tmp_dir, final_dir);
        io::sync_directory(out);
        fs::remove_all(old_dir, ec);
        fs::path latest_tmp = out / fmt::format(".latest.{}.tmp", owner);
        io::write_text_file(latest_tmp, name + "\n");  // (fsynced)
        rename_or_fail(latest_tmp, out / "latest");
        io::sync_directory(out);
    }
    comm.barrier();  // nobody reads `latest` before it points here
    return final_dir.string();
}

bool resumes_in_place(const std::string& ckpt_dir, const std::string& out_dir) {
    if (ckpt_dir.empty()) return false;
    const fs::path parent = fs::path(ckpt_dir).parent_path();
    std::error_code ec;
    return fs::equivalent(parent.empty() ? fs::path(".") : parent, out_dir, ec);
}

std::vector<std::string> prune_checkpoints(const std::string& out_dir, int keep_last,
                                           int keep_every, int64_t saved) {
    if (keep_last <= 0) return {};
    const fs::path out(out_dir);
    std::error_code ec;
    std::vector<std::pair<int64_t, std::string>> ckpts;  // (step, name), this run's up to saved
    for (const auto& e : fs::directory_iterator(out, ec)) {
        const std::string name = e.path().filename().string();
        if (!io::is_checkpoint_name(name) || !e.is_directory(ec) || name.size() > 23) continue;
        const int64_t step = std::stoll(name.substr(5));
        if (step <= saved) ckpts.push_back({step, name});
    }
    // Newest first: the one just saved, which `latest` names, is first and always kept.
    std::sort(ckpts.begin(), ckpts.end(), std::greater<>());
    std::vector<std::string> removed;
    for (std::size_t i = (std::size_t)keep_last; i < ckpts.size(); i++) {
        const auto& [step, name] = ckpts[i];
        if ((keep_every > 0 && step % keep_every == 0) || fs::exists(out / name / "keep", ec))
            continue;
        // (The stale-temporary sweep at start-up finishes a removal a crash interrupted.)
        const fs::path doomed = out / fmt::format(".{}.old.{}", name, (long long)::getpid());
        fs::rename(out / name, doomed, ec);
        if (ec) continue;  // (a checkpoint that cannot go stays; the next save tries again)
        fs::remove_all(doomed, ec);
        removed.push_back(name);
    }
    if (!removed.empty()) io::sync_directory(out);
    return removed;
}

namespace {

void write_checkpoint_files(const fs::path& tmp_dir, const RunConfig& cfg,
                            const CheckpointModel& weights, OptimizerState& opt,
                            const TrainState& state, dist::Communicator& comm) {
    const bool root = comm.rank() == 0;
    weights.save(tmp_dir.string(), root);

    // Optimizer state: one file when every rank's optimizer covers the whole layout (then every
    // rank holds the same state and rank 0 writes it), else one file per range of each rank (a
    // rank has one range, or one per chunk of an interleaved pipeline), numbered in rank order.
    // The ranks agree on it: a parameter server's one server holds it all while its workers
    // hold none.
    const std::size_t total = weights.layout.total;
    const std::vector<OptimizerState::Range> ranges = opt.ranges();
    int64_t partial = opt.count() != total || ranges.size() != 1;
    if (comm.size() > 1) comm.all_reduce_max(&partial, 1);
    const bool sharded = partial != 0;
    // How many files the ranks before this one write, and how many in all.
    int first_file = 0, files = 1;
    if (sharded) {
        std::vector<int64_t> per_rank(comm.size(), 0);
        const int64_t mine = (int64_t)ranges.size();
        comm.all_gather_bytes(&mine, per_rank.data(), sizeof(mine));
        files = 0;
        for (int r = 0; r < comm.size(); r++) {
            if (r == comm.rank()) first_file = files;
            files += (int)per_rank[r];
        }
    }
    if (!sharded && !root && opt.collective_read()) {
        // The ranks' part of root's reads (tensor parallelism's gathers); root writes alone.
        std::vector<float> staging(opt.count());
        for (const auto& name : opt.state_names()) opt.read_state(name, staging.data());
    }
    if (sharded || root) {
        const std::vector<std::string> names = opt.state_names();
        // State that lives outside host memory (the CUDA engine's), or in pieces, is copied out
        // one tensor at a time as the writer reaches it.
        std::vector<float> staging;
        auto tensor = [&](const std::string& name) -> const float* {
            if (const float* p = opt.host_state(name)) return p;
            staging.resize(opt.count());
            opt.read_state(name, staging.data());
            return staging.data();
        };
        std::size_t at = 0;  // the range's place in the state's concatenation
        std::vector<uint8_t> stored_bytes;
        for (std::size_t k = 0; k < ranges.size(); k++) {
            const OptimizerState::Range& rg = ranges[k];
            io::SafetensorsWriter w;
            w.set_metadata("format", "memtrain-optimizer-shard");
            w.set_metadata("optimizer", cfg.optim.name);
            w.set_metadata("offset", std::to_string(rg.offset));
            w.set_metadata("count", std::to_string(rg.count));
            w.set_metadata("total", std::to_string(total));
            // A state whose stored form is smaller than floats (compressed moments, Adafactor's
            // factors, Muon's masked moments) is written as those bytes, with its format.
            Optimizer* part = opt.stored_part(k);
            const bool stored = part != nullptr && part->compact();
            if (stored) {
                w.set_metadata("state_form", "stored");
                w.set_metadata("state_format", state_format_name(part->state_format()));
            }
            for (const auto& sname : names) {
                if (stored)
                    w.declare(sname, io::DType::U8, {(int64_t)part->stored_bytes(sname)});
                else
                    w.declare(sname, io::DType::F32, {(int64_t)rg.count});
            }
            const int index = sharded ? first_file + (int)k : 0;
            w.write((tmp_dir / optimizer_file(index, files)).string(),
                    [&](std::size_t i) -> const void* {
                        if (!stored) return tensor(names[i]) + at;
                        stored_bytes.resize(part->stored_bytes(names[i]));
                        part->save_stored(names[i], stored_bytes.data());
                        return stored_bytes.data();
                    });
            at += rg.count;
        }
    }

    if (root) {
        std::optional<data::Tokenizer> tok;
        if (!cfg.data.tokenizer.empty()) tok = data::Tokenizer::load(cfg.data.tokenizer);
        io::write_text_file(tmp_dir / "config.json",
                            tok ? hf_config_json(cfg.model, *tok) : hf_config_json(cfg.model));
        io::write_text_file(tmp_dir / "memtrain.toml", to_toml(cfg));
        io::SafetensorsWriter w;
        w.set_metadata("format", "memtrain-training-state");
        w.set_metadata("version", "2");
        w.set_metadata("optimizer", cfg.optim.name);
        w.set_metadata("optimizer_files", std::to_string(files));
        w.set_metadata("params", std::to_string(total));
        w.set_metadata("world_size", std::to_string(comm.size()));
        w.set_metadata("zero_stage", std::to_string(cfg.train.zero_stage));
        w.set_metadata("step", std::to_string(state.step));
        w.set_metadata("optimizer_steps", std::to_string(opt.steps_taken()));
        for (int i = 0; i < 4; i++)
            w.set_metadata(fmt::format("rng{}", i), std::to_string(state.rng[i]));
        w.set_metadata("data_epoch", std::to_string(state.data_epoch));
        w.set_metadata("data_cursor", std::to_string(state.data_cursor));
        if (state.data_tokens) w.set_metadata("data_tokens", std::to_string(state.data_tokens));
        if (state.data_fingerprint)
            w.set_metadata("data_fingerprint", std::to_string(state.data_fingerprint));
        if (state.tokenizer_fingerprint)
            w.set_metadata("tokenizer_fingerprint", std::to_string(state.tokenizer_fingerprint));
        if (state.clip_norm > 0) w.set_metadata("clip_norm", fmt::format("{}", state.clip_norm));
        if (state.loss_scale > 0) {
            w.set_metadata("loss_scale", fmt::format("{}", state.loss_scale));
            w.set_metadata("loss_scale_clean", std::to_string(state.loss_scale_clean));
        }
        w.write((tmp_dir / "training_state.safetensors").string());
        if (tok) tok->save((tmp_dir / "tokenizer.json").string());
    }
}

}  // namespace

std::string resolve_checkpoint_dir(const std::string& path, std::string* note) {
    fs::path p(path);
    std::error_code ec;
    if (!fs::exists(p, ec)) fail("checkpoint {} does not exist", path);
    // A LoRA run's checkpoint holds its adapters instead of the model.
    auto holds_weights = [](const fs::path& d) {
        std::error_code e;
        return fs::exists(d / "model.safetensors", e) ||
               fs::exists(d / "adapter_model.safetensors", e);
    };
    if (holds_weights(p)) return p.string();
    const fs::path latest = p / "latest";
    const bool has_latest = fs::exists(fs::symlink_status(latest, ec));
    std::string name;
    if (has_latest) {
        name = io::read_text_file(latest, 4096);
        const auto first = name.find_first_not_of(" \t\r\n");
        name = first == std::string::npos
                   ? std::string()
                   : name.substr(first, name.find_last_not_of(" \t\r\n") - first + 1);
        // Only a checkpoint of this directory: "../other_run/ckpt_000002" would resume another
        // run and write into it. (Its content is not echoed: `latest` may be a link to any file.)
        if (!name.empty() && !io::is_checkpoint_name(name))
            fail(
                "{}/latest does not name a checkpoint of {} (it must hold ckpt_ and digits, "
                "nothing else); refusing to follow it",
                path, path);
        if (!name.empty() && complete_checkpoint(p / name)) return (p / name).string();
    }
    // `latest` empty, naming a checkpoint that is missing or incomplete (after a power cut,
    // say), or absent while checkpoints are there: the newest complete one, said aloud.
    const std::string best = newest_complete_checkpoint(p);
    if (best.empty()) {
        if (has_latest)
            fail(
                "{}/latest points at {}, which holds no complete checkpoint, and no other "
                "complete ckpt_* is there",
                path, (p / name).string());
        fail(
            "{} is neither a checkpoint directory (no model.safetensors) nor an output directory "
            "with a 'latest' file",
            path);
    }
    const std::string why = !has_latest    ? "there is no latest"
                            : name.empty() ? "latest is empty"
                            : fs::exists(p / name, ec)
                                ? fmt::format("latest names {}, which is incomplete", name)
                                : fmt::format("latest names {}, which is missing", name);
    const std::string msg =
        fmt::format("{}: {}; using {}, the newest complete checkpoint", path, why, best);
    if (note)
        *note = msg;
    else
        std::fprintf(stderr, "memtrain: warning: %s\n", msg.c_str());
    return (p / best).string();
}

RunConfig checkpoint_config(const std::string& dir) {
    fs::path p = fs::path(dir) / "memtrain.toml";
    std::error_code ec;
    if (!fs::exists(p, ec)) fail("checkpoint {} has no memtrain.toml", dir);
    RunConfig cfg = parse_run_config(io::read_text_file(p, kMaxConfigBytes), p.string(), {});
    // A downloaded checkpoint is outside input: its model is checked (and bounded) before any
    // layout is built from it.
    try {
        cfg.model.validate();
    } catch (const Error& e) {
        fail("{}: {}", p.string(), e.what());
    }
    return cfg;
}

namespace {

// The training state's metadata, its format and version checked.
TrainState read_state_metadata(const io::SafetensorsFile& f, const std::string& spath) {
    if (meta(f, "format", spath) != "memtrain-training-state")
        fail("{}: not a memtrain training state", spath);
    if (meta(f, "version", spath) != "2")
        fail("{}: training state version {} is not supported (this build reads version 2)", spath,
             meta(f, "version", spath));
    TrainState st;
    st.step = (int64_t)meta_u64(f, "step", spath);
    for (int i = 0; i < 4; i++) st.rng[i] = meta_u64(f, fmt::format("rng{}", i), spath);
    st.data_epoch = meta_u64(f, "data_epoch", spath);
    st.data_cursor = meta_u64(f, "data_cursor", spath);
    if (f.metadata().count("loss_scale")) {  // fp16 runs only
        st.loss_scale =
            meta_number(f, "loss_scale", spath, "positive", [](double x) { return x > 0; });
        st.loss_scale_clean = (int64_t)meta_u64(f, "loss_scale_clean", spath);
    }
    if (f.metadata().count("clip_norm"))
        st.clip_norm =
            meta_number(f, "clip_norm", spath, "non-negative", [](double x) { return x >= 0; });
    for (auto [key, field] : {std::pair{"data_tokens", &st.data_tokens},
                              std::pair{"data_fingerprint", &st.data_fingerprint},
                              std::pair{"tokenizer_fingerprint", &st.tokenizer_fingerprint}})
        if (f.metadata().count(key)) *field = meta_u64(f, key, spath);
    return st;
}

}  // namespace

TrainState checkpoint_state(const std::string& dir) {
    const std::string spath = (fs::path(dir) / "training_state.safetensors").string();
    return read_state_metadata(io::SafetensorsFile::open(spath), spath);
}

TrainState load_checkpoint(const std::string& dir, const CheckpointModel& weights,
                           OptimizerState& opt) {
    RunConfig saved = checkpoint_config(dir);
    const ModelConfig &a = saved.model, &b = weights.model;
    if (a.n_layer != b.n_layer || a.n_head != b.n_head || a.n_embd != b.n_embd ||
        a.block_size != b.block_size || a.vocab_size != b.vocab_size ||
        a.padded_vocab() != b.padded_vocab())
        fail(
            "checkpoint {} holds a model of n_layer={} n_head={} n_embd={} block_size={} "
            "vocab_size={}, but the config asks for n_layer={} n_head={} n_embd={} "
            "block_size={} vocab_size={}",
            dir, a.n_layer, a.n_head, a.n_embd, a.block_size, a.vocab_size, b.n_layer, b.n_head,
            b.n_embd, b.block_size, b.vocab_size);
    weights.load(dir);

    std::string spath = (fs::path(dir) / "training_state.safetensors").string();
    auto f = io::SafetensorsFile::open(spath);
    TrainState st = read_state_metadata(f, spath);
    if (meta(f, "optimizer", spath) != saved.optim.name)
        fail("{}: optimizer state is for '{}'", spath, meta(f, "optimizer", spath));
    const std::size_t total = weights.layout.total;
    if (meta_u64(f, "params", spath) != total)
        fail("{}: state of {} parameters, the model has {}", spath, meta_u64(f, "params", spath),
             total);
    opt.set_steps_taken((int64_t)meta_u64(f, "optimizer_steps", spath));

    // This rank's optimizer ranges, assembled from whichever files overlap them: the files may
    // come from another world size, ZeRO stage or pipeline layout. Files may overlap one another
    // (pipelines side by side each write their stage's range whole): they hold the same values,
    // and what counts is that together they cover every range.
    const uint64_t files = meta_u64(f, "optimizer_files", spath);
    if (files == 0 || files > 1'000'000) fail("{}: optimizer_files = {} is invalid", spath, files);
    const std::vector<OptimizerState::Range> ranges = opt.ranges();
    // Per range: the [a, b) pieces read, for the coverage.
    std::vector<std::vector<std::pair<std::size_t, std::size_t>>> pieces(ranges.size());
    const std::vector<std::string> names = opt.state_names();
    for (uint64_t k = 0; k < files; k++) {
        const std::string opath = (fs::path(dir) / optimizer_file((int)k, (int)files)).string();
        auto of = io::SafetensorsFile::open(opath);
        const std::size_t off = meta_u64(of, "offset", opath), cnt = meta_u64(of, "count", opath);
        if (meta_u64(of, "total", opath) != total || off + cnt > total)
            fail("{}: slice [{}, {}) does not fit the model's {} parameters", opath, off, off + cnt,
                 total);
        // A file in the stored form: its bytes go straight into the optimizer of the same range
        // and format, else are decoded as floats by a scratch optimizer of the file's range and
        // format (another world size, ZeRO stage or optim.state_format).
        const bool stored = of.metadata().count("state_form") != 0;
        if (stored && meta(of, "state_form", opath) != "stored")
            fail("{}: state_form = '{}' is not known (this build writes 'stored')", opath,
                 meta(of, "state_form", opath));
        const StateFormat file_format =
            stored ? parse_state_format(meta(of, "state_format", opath)) : StateFormat::Fp32;
        auto stored_tensor = [&](const std::string& sname, std::size_t bytes) {
            const io::TensorInfo& info = of.get(sname);
            if (info.dtype != io::DType::U8 || info.shape != std::vector<int64_t>{(int64_t)bytes})
                fail(
                    "{}: tensor '{}' must be U8 of shape [{}] (its {} state over [{}, {})), it is "
                    "{} {}",
                    opath, sname, bytes, state_format_name(file_format), off, off + cnt,
                    io::dtype_name(info.dtype), io::shape_string(info.shape));
            return static_cast<const uint8_t*>(of.data(info));
        };
        // This rank's ranges the file overlaps: each copied in as it is where the range and
        // format are the file's, else written as floats below.
        struct Overlap {
            std::size_t a, b, at;  // [a, b) of the buffer; `at`: its place in the state
        };
        std::vector<Overlap> as_floats;
        std::size_t at = 0;  // the range's place in the state's concatenation
        for (std::size_t j = 0; j < ranges.size(); j++) {
            const std::size_t lo = ranges[j].offset, hi = lo + ranges[j].count;
            const std::size_t a = std::max(lo, off), b = std::min(hi, off + cnt);
            if (a < b) {
                Optimizer* part = opt.stored_part(j);
                if (stored && part && off == lo && cnt == hi - lo &&
                    part->state_format() == file_format) {
                    for (const auto& sname : names)
                        part->load_stored(sname, stored_tensor(sname, part->stored_bytes(sname)));
                } else {
                    as_floats.push_back({a, b, at + (a - lo)});
                }
                pieces[j].emplace_back(a, b);
            }
            at += ranges[j].count;
        }
        if (as_floats.empty()) continue;
        // The file's floats of each state: read as they are, or decoded once by a scratch
        // optimizer of the file's range and format.
        std::unique_ptr<Optimizer> decoder;
        std::vector<float> decoded;
        if (stored) {
            OptimConfig oc = saved.optim;
            oc.state_format = state_format_name(file_format);
            decoder = make_optimizer(oc, weights.layout, off, cnt, MemCategory::Other);
            decoded.resize(cnt);
        }
        for (const auto& sname : names) {
            const float* src;
            if (stored) {
                decoder->load_stored(sname, stored_tensor(sname, decoder->stored_bytes(sname)));
                decoder->read_state(sname, decoded.data());
                src = decoded.data();
            } else {
                const io::TensorInfo& info = of.get(sname);
                if (info.dtype != io::DType::F32 ||
                    info.shape != std::vector<int64_t>{(int64_t)cnt})
                    fail("{}: tensor '{}' must be F32 of shape [{}], it is {} {}", opath, sname,
                         cnt, io::dtype_name(info.dtype), io::shape_string(info.shape));
                src = static_cast<const float*>(of.data(info));
            }
            for (const Overlap& o : as_floats)
                opt.write_state(sname, o.at, o.b - o.a, src + (o.a - off));
        }
    }
    opt.finish_writes();
    for (std::size_t j = 0; j < ranges.size(); j++) {
        const std::size_t lo = ranges[j].offset, hi = lo + ranges[j].count;
        std::sort(pieces[j].begin(), pieces[j].end());
        std::size_t covered = 0, reach = lo;
        for (const auto& [a, b] : pieces[j]) {
            if (b <= reach) continue;
            covered += b - std::max(a, reach);
            reach = b;
        }
        if (covered != hi - lo)
            fail("{}: the optimizer files cover {} of the {} values this rank needs [{}, {})", dir,
                 covered, hi - lo, lo, hi);
    }
    return st;
}

}  // namespace memtrain
