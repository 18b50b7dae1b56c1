// The training loop (see trainer.h).
#include "train/trainer.h"
#include "train/validate.h"

#include <cblas.h>
#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <thread>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/phase_clock.h"
#include "core/progress.h"
#include "data/tokenizer.h"
#include "engine/cpu/cpu_engine.h"
#include "engine/host_memory.h"
#include "engine/run_plan.h"
#include "io/model_source.h"
#include "io/run_report.h"
#include "optim/schedule.h"
#include "parallel/pipeline/schedule.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "remat/cost.h"
#include "remat/policy.h"
#include "remat/profile.h"
#include "train/build.h"
#include "train/diagnose.h"
#include "train/plan.h"
#include "train/report.h"
#include "train/sample.h"

namespace fs = std::filesystem;

namespace memtrain {

namespace {

// fp16 holds magnitudes up to 65504. Weights beyond that (a checkpoint trained in bf16 or fp32
// may have them) round to inf in the first forward, and every step then overflows until the
// loss scale collapses; refuse them before training instead, naming the tensor. Every rank calls
// it (under ZeRO-3 acquiring a unit gathers it).
void check_fp16_range(const ModelWeights& w, const std::string& source) {
    constexpr float kFp16Max = 65504.0f;
    for (int u = 0; u < (int)w.layout.units.size(); u++) {
        const ParamUnit& unit = w.layout.units[u];
        const float* p = w.store.acquire(u);
        std::string bad;
        for (std::size_t i = unit.first_tensor; i < unit.last_tensor && bad.empty(); i++) {
            const ParamSpec& t = w.layout.tensors[i];
            const float* v = p + (t.offset - unit.begin);
            float top = 0;
            for (std::size_t k = 0; k < t.numel; k++) top = std::max(top, std::fabs(v[k]));
            if (!(top <= kFp16Max))
                bad = fmt::format("{} holds a weight of magnitude {:g}", t.name, top);
        }
        w.store.release(u);
        if (!bad.empty())
            fail(
                "model.init_from = {}: {}, beyond fp16's largest finite value {:g}; train it in "
                "bf16 (train.precision = \"bf16\"), which has fp32's range",
                source, bad, kFp16Max);
    }
}

}  // namespace

void check_out_dir(const std::string& out_dir, int rank) {
    if (out_dir.empty())
        fail("io.out_dir is empty: give the directory for checkpoints and metrics");
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    if (ec) fail("io.out_dir = \"{}\": cannot create the directory: {}", out_dir, ec.message());
    if (!fs::is_directory(out_dir, ec))
        fail("io.out_dir = \"{}\" exists and is not a directory", out_dir);
    const std::string probe =
        (fs::path(out_dir) / fmt::format(".memtrain_write_test.{}.{}", rank, ::getpid())).string();
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        fail("io.out_dir = \"{}\": cannot write in the directory: {}", out_dir,
             std::strerror(errno));
    ::close(fd);
    ::unlink(probe.c_str());
}

Trainer::Trainer(RunConfig cfg, TrainOptions opts, dist::Communicator* comm)
    : cfg_(std::move(cfg)), opts_(std::move(opts)) {
    if (!comm) {
        own_comm_ = std::make_unique<dist::LocalCommunicator>();
        comm = own_comm_.get();
    }
    comm_ = comm;
    cfg_.world = comm_->size();
    validate_config(cfg_);
    // Checkpoints record train.device and train.precision as written ("auto" stays "auto": a
    // resume on another machine resolves it there); the run uses what they resolve to here.
    written_device_ = cfg_.train.device;
    written_precision_ = cfg_.train.precision;
    resolve_config(cfg_);
    // "auto" micro-batch: chosen from the plan before anything is allocated, the same on every
    // rank (and saved in checkpoints as chosen).
    const std::string auto_micro_batch = resolve_micro_batch(cfg_, *comm_);
    if (!auto_micro_batch.empty() && root() && !opts_.quiet)
        std::fprintf(stderr, "memtrain: %s\n", auto_micro_batch.c_str());
    // Every rank must run the same configuration (and resume the same checkpoint).
    dist::check_same_config(*comm_, to_toml(cfg_) + "\nresume = " + opts_.resume);
    int threads = cfg_.train.threads;
    if (threads == 0 && comm_->local_size() > 1)  // share the node's cores between its ranks
        threads = std::max(1, omp_get_num_procs() / comm_->local_size());
    if (threads > 0) {
        omp_set_num_threads(threads);
        openblas_set_num_threads(threads);
    }
    if (cfg_.data.train.empty())
        fail("data.train is not set: give a token shard (memtrain tokenize writes train.bin)");
    std::string resume_dir, resume_note;
    if (!opts_.resume.empty()) resume_dir = resolve_checkpoint_dir(opts_.resume, &resume_note);
    // The out_dir is this run's alone (docs/training.md, "The out_dir"): rank 0 locks it for the
    // run's life, then judges what is in it. The ranks agree before going on, so a refusal on
    // rank 0 does not leave the others waiting in a collective.
    bool clear_old_run = false;
    std::string refusal;
    if (root()) {
        try {
            check_out_dir(cfg_.io.out_dir);
            lock_ = io::OutDirLock(cfg_.io.out_dir);
            io::remove_stale_temporaries(cfg_.io.out_dir);  // dead saves' (we hold the lock)
            // Resuming a checkpoint of this out_dir continues its run; anything else is new here.
            const bool continuing = resumes_in_place(resume_dir, cfg_.io.out_dir);
            const std::string evidence = io::run_evidence(cfg_.io.out_dir, cfg_.io.metrics);
            if (opts_.refuse_existing_run && !continuing && !evidence.empty()) {
                if (!opts_.overwrite)
                    fail(
                        "io.out_dir = \"{}\" holds another run ({} is there); a new run would "
                        "overwrite its checkpoints and metrics. Continue it with memtrain train "
                        "--resume {}, give this run another io.out_dir, or pass --overwrite to "
                        "replace it",
                        cfg_.io.out_dir, evidence, cfg_.io.out_dir);
                clear_old_run = true;
            }
        } catch (const Error& e) {
            refusal = e.what();
        }
    }
    int64_t refused = refusal.empty() ? 0 : 1;
    if (comm_->size() > 1) comm_->all_reduce_max(&refused, 1);
    if (refused) {
        if (!refusal.empty()) fail("{}", refusal);
        fail("rank 0 cannot use io.out_dir = \"{}\" (it says why)", cfg_.io.out_dir);
    }
    if (!resume_note.empty() && root())
        std::fprintf(stderr, "memtrain: warning: %s\n", resume_note.c_str());
    if (root() && !opts_.quiet)
        for (const std::string& w : config_warnings(cfg_))
            std::fprintf(stderr, "memtrain: warning: %s\n", w.c_str());
    std::optional<RunConfig> saved;
    TrainState saved_state;
    if (!resume_dir.empty()) {
        saved = checkpoint_config(resume_dir);
        saved_state = checkpoint_state(resume_dir);
        if (saved->optim.name != cfg_.optim.name)
            fail("checkpoint {} was trained with optim.name = \"{}\", the config says \"{}\"",
                 resume_dir, saved->optim.name, cfg_.optim.name);
        // The checkpoint holds the moments decoded, so any format loads from any other.
        if (saved->optim.state_format != cfg_.optim.state_format && root() && !opts_.quiet)
            std::fprintf(stderr,
                         "memtrain: resume: the optimizer state of %s (optim.state_format = "
                         "\"%s\") is converted to \"%s\"\n",
                         resume_dir.c_str(), saved->optim.state_format.c_str(),
                         cfg_.optim.state_format.c_str());
    }
    print("config (all of it as TOML: memtrain train ... --print-config)\n" + format_table(cfg_));

    // The run decided before anything is allocated (engine/run_plan.h): the engine, the layout,
    // the remat schedule for the engine's arenas (fixed for the run: the arena is sized once to
    // its layout), and this rank's memory, refused with what would fit when it cannot fit the
    // host or the device.
    plan_ = plan_run(cfg_, *comm_);
    const remat::Solution* schedule = &plan_.remat;
    engine_ = opts_.engine ? opts_.engine(plan_, *comm_) : make_engine(plan_, *comm_);
    if (!(engine_->arena_format() == plan_.format))
        fail("internal: the {} engine lays out its arenas unlike its plan", engine_->describe());
    engine_->set_remat(schedule->plan);
    if (cfg_.train.diagnostics == "amp" && !engine_->has_gradient_histograms())
        fail(
            "train.diagnostics = \"amp\" reads the gradients of the CPU engine (one process, "
            "DDP, ZeRO 0-3) and of the CUDA engine on one GPU; {} cannot give them yet (train.tp, "
            "train.pp, a parameter server, GPUs under NCCL, optimizer offload and LoRA are not "
            "covered)",
            engine_->describe());
    if (!opts_.engine) {
        // The engine allocated what its plan predicted, row for row: the report prints the plan.
        const auto built = engine_->predicted_memory(cfg_.micro_batch(), cfg_.train.seq_len);
        for (std::size_t i = 0; i < plan_.memory.size(); i++) {
            const MemoryPrediction& want = plan_.memory[i];
            if (i >= built.size() || built[i].category != want.category ||
                built[i].bytes != want.bytes)
                fail("internal: the {} engine predicts {} where its plan predicted {} bytes of {}",
                     engine_->describe(),
                     i < built.size() ? fmt::format("{} bytes of {}", built[i].bytes,
                                                    category_name(built[i].category))
                                      : std::string("fewer rows"),
                     want.bytes, category_name(want.category));
        }
    }
    if (cfg_.train.remat != "none") {
        std::string letters;
        for (BlockKeep k : schedule->plan) letters += keep_letter(k);
        print(
            fmt::format("remat {}: blocks keep [{}] ({}) | activations {} | recompute {:.1f}% of a "
                        "step ({})\n",
                        cfg_.train.remat, letters, kKeepLetters, mib(schedule->peak_bytes),
                        100.0 * schedule->recompute_flops / plan_.step_cost,
                        plan_.costs_measured ? "measured time" : "analytic FLOPs"));
    }
    // Every rank reads the whole global micro-batch (tokens are cheap) and keeps its rows, so the
    // data position is one number for the run, whatever its world size.
    const int B = cfg_.micro_batch(), T = cfg_.train.seq_len, Bg = B * cfg_.dp();
    train_loader_ =
        std::make_unique<data::DataLoader>(cfg_.data.train, Bg, T, cfg_.train.seed, true);
    if (!cfg_.data.val.empty())
        val_loader_ = std::make_unique<data::DataLoader>(cfg_.data.val, Bg, T, 0, false);
    for (auto* l : {train_loader_.get(), val_loader_.get()}) {
        if (l && l->shard().vocab_size() > (uint32_t)cfg_.model.vocab_size)
            fail("token shard vocabulary ({}) is larger than model.vocab_size ({})",
                 l->shard().vocab_size(), cfg_.model.vocab_size);
    }
    std::optional<uint64_t> tokenizer_fp;
    if (!cfg_.data.tokenizer.empty()) {
        auto tok = data::Tokenizer::load(cfg_.data.tokenizer);
        tokenizer_fp = tok.fingerprint();
        if (tok.vocab_size() > cfg_.model.vocab_size)
            fail("tokenizer {} has {} tokens but model.vocab_size is {}", cfg_.data.tokenizer,
                 tok.vocab_size(), cfg_.model.vocab_size);
        // Shards must come from this tokenizer (fingerprint, or vocab size for old shards).
        for (auto* l : {train_loader_.get(), val_loader_.get()}) {
            if (l)
                data::check_shard_tokenizer(l->shard(), cfg_.data.tokenizer, tok.fingerprint(),
                                            (uint32_t)tok.vocab_size());
        }
    }
    xg_.resize((std::size_t)Bg * T);
    yg_.resize((std::size_t)Bg * T);
    if (saved) {
        const std::string changes = resume_changes(resume_dir, *saved, saved_state, tokenizer_fp);
        if (!changes.empty() && !opts_.accept_changes)
            fail(
                "resuming {} with {}: that is not the run it continues (the data order, the "
                "meaning of token ids or the step's batch would change under it). Resume with "
                "the checkpoint's own values, or add --accept-changes to continue anyway",
                resume_dir, changes);
        if (!changes.empty())
            print(fmt::format("resume: continuing with changes (--accept-changes): {}\n", changes));
        if (changes.empty() && saved->data.train != cfg_.data.train)
            print(fmt::format("resume: data.train is now {} (was {}), with the same {} tokens\n",
                              cfg_.data.train, saved->data.train, train_loader_->shard().size()));
    }

    state_.rng = Rng(cfg_.train.seed ^ 0x5A3D1Eull).state();
    // A LoRA checkpoint holds only the adapters: its frozen base comes from model.init_from (or
    // the seed) as at the start of the run, then the checkpoint on top.
    const bool weights_in_checkpoint = !resume_dir.empty() && !cfg_.lora.enabled();
    if (!weights_in_checkpoint) {
        if (!cfg_.model.init_from.empty()) {
            load_init_weights(engine_->weights(), cfg_.model.init_from, cfg_.model.init_partial);
            if (cfg_.train.precision == "fp16")
                check_fp16_range(engine_->weights(), cfg_.model.init_from);
            print(fmt::format("initialised {}weights from {}\n",
                              cfg_.lora.enabled() ? "frozen base " : "", cfg_.model.init_from));
        } else {
            init_gpt2_weights(engine_->weights(), cfg_.train.seed);
        }
    }
    engine_->weights_loaded();
    if (!resume_dir.empty()) {
        load_state(resume_dir);
        if (opts_.reset_data) {
            state_.data_epoch = 0;
            state_.data_cursor = 0;
        }
        train_loader_->set_position({state_.data_epoch, state_.data_cursor});
        print(fmt::format(
            "resumed from {} at step {}{}\n", resume_dir, state_.step,
            opts_.reset_data
                ? fmt::format(", reading {} from its start (--reset-data)", cfg_.data.train)
                : std::string()));
    }

    peak_lr_ = scaled_peak_lr(cfg_.optim, cfg_.tokens_per_step());
    const std::size_t psi = engine_->weights().layout.total;
    print(fmt::format(
        "device: {} | model: {} parameters ({} with vocab padding) | batch {} x {} tokens = {} "
        "tokens/step | micro-batch {} x {} accumulation steps{}\n",
        engine_->describe(),
        psi - (std::size_t)(cfg_.model.padded_vocab() - cfg_.model.vocab_size) * cfg_.model.n_embd,
        psi, cfg_.train.batch_size, T, cfg_.tokens_per_step(), B, cfg_.accum_steps(),
        layout_line()));
    print("plan: " + plan_.summary() + " (--print-plan)\n");
    if (cfg_.guard.enabled) {
        // A parameter server's workers and PipeDream's stages update out of step with the run's
        // step count, so there is no one state to go back to.
        const bool weight_versions =
            cfg_.train.pp > 1 && cfg_.train.pp_schedule.rfind("pipedream", 0) == 0;
        if (cfg_.ps() || weight_versions)
            print(fmt::format("guard: off ({} has no single state to roll back to)\n",
                              cfg_.ps() ? "a parameter server" : "PipeDream"));
        else
            guard_ = std::make_unique<DivergenceGuard>(cfg_.guard);
        if (guard_) engine_->set_guarded(true);
    }
    if (cfg_.optim.lr_scaling != "none")
        print(fmt::format("lr scaling ({}): peak lr {} x ({} / {} tokens){} = {:.3e}\n",
                          cfg_.optim.lr_scaling, cfg_.optim.lr, cfg_.tokens_per_step(),
                          cfg_.optim.lr_reference_batch,
                          cfg_.optim.lr_scaling == "sqrt" ? "^0.5" : "", peak_lr_));

    // What this run trains on, recorded in its checkpoints for the next resume to compare.
    state_.data_tokens = train_loader_->shard().size();
    state_.data_fingerprint = train_loader_->shard().tokenizer_fingerprint().value_or(0);
    state_.tokenizer_fingerprint = tokenizer_fp.value_or(0);

    if (root()) {
        if (clear_old_run) {  // --overwrite, now that the run has passed every check
            io::clear_run(cfg_.io.out_dir, cfg_.io.metrics);
            print(fmt::format("--overwrite: removed the run that was in {}\n", cfg_.io.out_dir));
        }
        // The guard's snapshots of a run that died: scratch, never resumed from.
        std::error_code ec;
        fs::remove_all(guard_dir(), ec);
        // io.metrics is a plain file name (validate_config), so this stays in out_dir.
        const std::string mpath = (fs::path(cfg_.io.out_dir) / cfg_.io.metrics).string();
        metrics_ = std::make_unique<io::MetricsLog>(mpath, !resume_dir.empty());
        if (!metrics_->note().empty())
            std::fprintf(stderr, "memtrain: note: %s\n", metrics_->note().c_str());
        // Steps after the checkpoint were logged by the run that died and are logged again
        // now: the marker tells `memtrain report` to drop the earlier lines for them.
        if (!resume_dir.empty())
            log_metrics(fmt::format("{{\"step\": {}, \"event\": \"resume\"}}", state_.step));
    }
}

Trainer::~Trainer() = default;

RunConfig Trainer::config_as_written() const {
    RunConfig c = cfg_;
    c.train.device = written_device_;
    c.train.precision = written_precision_;
    return c;
}

void Trainer::log_metrics(const std::string& line) {
    if (!metrics_ || metrics_->failed()) return;
    if (!metrics_->write(line)) {
        metrics_failed_at_ = std::max<int64_t>(1, state_.step);
        std::fprintf(stderr,
                     "memtrain: warning: %s at step %lld; metrics.jsonl stops here (it ends in "
                     "a complete line), training goes on\n",
                     metrics_->error().c_str(), (long long)state_.step);
    }
}

std::string Trainer::resume_changes(const std::string& dir, const RunConfig& saved,
                                    const TrainState& st,
                                    std::optional<uint64_t> tokenizer_fp) const {
    std::vector<std::string> changes;
    // Keys whose change makes the resumed run another run: what it reads, in what order and
    // batches, and the numerics of a model whose shape (checked on load) is the same.
    // The data is named by what it holds (its token count and tokenizer, below), not by its
    // path: a shard copied or moved elsewhere continues the run.
    for (const char* key : {"train.seq_len", "train.batch_size", "train.seed", "model.norm_eps",
                            "model.rope_theta", "lora.alpha"}) {
        const std::string was = config_value(saved, key), now = config_value(cfg_, key);
        if (was != now) changes.push_back(fmt::format("{} {} (was {})", key, now, was));
    }
    // The same path may hold other tokens now, or the tokenizer another vocabulary. (New data
    // read from its start, opts_.reset_data, is what the user asked for.)
    if (st.data_tokens && st.data_tokens != train_loader_->shard().size() && !opts_.reset_data)
        changes.push_back(fmt::format("a data.train of {} tokens (was {})",
                                      train_loader_->shard().size(), st.data_tokens));
    const uint64_t shard_fp = train_loader_->shard().tokenizer_fingerprint().value_or(0);
    if (st.data_fingerprint && shard_fp && st.data_fingerprint != shard_fp)
        changes.push_back(fmt::format("a data.train tokenized by tokenizer {:016x} (was {:016x})",
                                      shard_fp, st.data_fingerprint));
    if (st.tokenizer_fingerprint && tokenizer_fp && st.tokenizer_fingerprint != *tokenizer_fp)
        changes.push_back(fmt::format("data.tokenizer of fingerprint {:016x} (was {:016x})",
                                      *tokenizer_fp, st.tokenizer_fingerprint));
    (void)dir;
    std::string out;
    for (const auto& c : changes) out += (out.empty() ? "" : ", ") + c;
    return out;
}

void Trainer::print(const std::string& s) {
    if (!opts_.quiet && root()) {
        std::fputs(s.c_str(), stdout);
        std::fflush(stdout);
    }
}

std::string Trainer::layout_line() const {
    if (cfg_.ps())
        return fmt::format(" x {} workers | parameter server: {} server ranks, staleness {}",
                           cfg_.dp(), cfg_.train.ps_servers, cfg_.train.ps_staleness);
    std::string out;
    if (cfg_.train.tp > 1)
        out += fmt::format(" | tensor parallel over {} ranks (heads, MLP and vocabulary split{})",
                           cfg_.train.tp,
                           cfg_.train.sequence_parallel
                               ? "; sequence parallel: norms and residual stream split by tokens"
                               : "");
    if (cfg_.train.pp > 1)
        out += fmt::format(
            " | pipeline of {} stages ({} schedule{}){}", cfg_.train.pp, cfg_.train.pp_schedule,
            cfg_.train.pp_virtual > 1 ? fmt::format(", {} chunks per rank", cfg_.train.pp_virtual)
                                      : "",
            cfg_.dp() > 1
                ? fmt::format(" x {} pipelines (ZeRO stage {})", cfg_.dp(), cfg_.train.zero_stage)
                : std::string());
    else if (cfg_.train.tp > 1 && cfg_.dp() > 1)
        out += fmt::format(" x {} replicas (gradients all-reduced)", cfg_.dp());
    else if (cfg_.train.tp == 1 && cfg_.world > 1)
        out += fmt::format(" x {} ranks (ZeRO stage {})", cfg_.world, cfg_.train.zero_stage);
    return out;
}

namespace {

struct SlowdownForTest {
    int data_ms = 0;
    int rank = -1, rank_ms = 0;
};

// Test hooks of `memtrain diagnose`'s tests (docs/diagnose.md): MEMTRAIN_TEST_SLOW_DATA_MS=N
// sleeps N ms in each batch's load, MEMTRAIN_TEST_SLOW_RANK=R:N N ms in each micro-batch's
// compute on rank R. Unset in every real run.
SlowdownForTest slowdown_for_test() {
    SlowdownForTest s;
    if (const char* v = std::getenv("MEMTRAIN_TEST_SLOW_DATA_MS"); v && *v)
        s.data_ms = std::atoi(v);
    if (const char* v = std::getenv("MEMTRAIN_TEST_SLOW_RANK"); v && *v) {
        const char* colon = std::strchr(v, ':');
        if (colon == nullptr) fail("MEMTRAIN_TEST_SLOW_RANK = {}: expected RANK:MILLISECONDS", v);
        s.rank = std::atoi(v);
        s.rank_ms = std::atoi(colon + 1);
    }
    return s;
}

// A metrics line's "phases_ms" object: this rank's milliseconds in each phase of the step.
std::string phases_field(const PhaseTimes& t) {
    std::string out;
    for (std::size_t i = 0; i < kPhases; i++)
        out += fmt::format("{}\"{}\": {:.3f}", i ? ", " : "", phase_key((Phase)i), 1e3 * t.s[i]);
    return out;
}

}  // namespace

void Trainer::write_timings(int64_t steps, double seconds, const PhaseTimes& phases) {
    // Every rank's sums to rank 0 (a collective: every rank ends the loop at the same step).
    std::array<double, 2 + kPhases> mine{};
    mine[0] = (double)steps;
    mine[1] = seconds;
    std::copy(phases.s.begin(), phases.s.end(), mine.begin() + 2);
    std::vector<double> all(mine.size() * (std::size_t)comm_->size());
    comm_->all_gather_bytes(mine.data(), all.data(), (int64_t)sizeof(mine));
    if (!root()) return;
    RunTimings t;
    t.steps = (int)steps;
    t.engine = engine_name(plan_.engine);
    t.gpu = plan_.gpu();
    t.dp = plan_.mesh.dp;
    t.tp = plan_.mesh.tp;
    t.pp = plan_.mesh.pp;
    t.ps_servers = plan_.ps_servers;
    t.micro_batches = plan_.accum_steps;
    t.virtual_stages = plan_.virtual_stages;
    if (t.pp > 1) {
        t.schedule = pp::kind_name(plan_.schedule);
        t.bubble_fraction =
            pp::uniform_bubble(plan_.schedule, t.pp, t.micro_batches, t.virtual_stages);
    }
    t.remat = plan_.remat_policy;
    t.tokens_per_step = cfg_.tokens_per_step();
    t.recompute_fraction =
        plan_.step_cost > 0 ? (double)plan_.remat.recompute_flops / plan_.step_cost : 0;
    const double per = steps > 0 ? 1.0 / (double)steps : 0;
    for (int r = 0; r < comm_->size(); r++) {
        const double* v = all.data() + (std::size_t)r * mine.size();
        RankTimes rt;
        rt.rank = r;
        rt.stage = plan_.mesh.stage_of(r);
        rt.replica = plan_.mesh.replica_of(r);
        rt.shard = plan_.mesh.shard_of(r);
        rt.step_s = v[1] * per;
        for (std::size_t i = 0; i < kPhases; i++) rt.phases.s[i] = v[2 + i] * per;
        t.ranks.push_back(rt);
    }
    try {
        write_timings_json((fs::path(cfg_.io.out_dir) / "timings.json").string(), t);
    } catch (const Error& e) {  // the run itself succeeded; say what diagnose will lack
        std::fprintf(stderr, "memtrain: warning: timings.json not written: %s\n", e.what());
    }
}

double Trainer::mean_over_ranks(double x) {
    // A pipeline's stages report the same loss (the last stage's, averaged over the pipelines
    // when there are several), a parameter server's ranks the mean over its workers,
    // tensor-parallel ranks the group's one loss; data-parallel ranks their own.
    if (plan_.loss_is_global()) return x;
    std::vector<double> all((std::size_t)comm_->size());
    comm_->all_gather_bytes(&x, all.data(), sizeof(double));
    double sum = 0;
    for (double v : all) sum += v;
    return sum / comm_->size();
}

void Trainer::next_rows(data::DataLoader& loader) {
    loader.next_batch(xg_.data(), yg_.data());
}

float Trainer::evaluate() {
    const int B = cfg_.micro_batch(), T = cfg_.train.seq_len;
    const std::size_t rows = (std::size_t)dp_rank() * B * T;
    val_loader_->reset();
    int n = std::min<int>(cfg_.train.eval_batches,
                          std::max<std::size_t>(1, val_loader_->num_windows() / (B * cfg_.dp())));
    double total = 0;
    for (int i = 0; i < n; i++) {
        next_rows(*val_loader_);
        total += engine_->forward_loss(xg_.data() + rows, yg_.data() + rows, B, T);
    }
    return (float)mean_over_ranks(total / n);
}

TrainSummary Trainer::run() {
    TrainSummary sum;
    const auto run_start = std::chrono::steady_clock::now();
    const int64_t first_step = state_.step;
    const int B = cfg_.micro_batch(), T = cfg_.train.seq_len, K = cfg_.accum_steps();
    const std::size_t rows = (std::size_t)dp_rank() * B * T;
    const int64_t total = cfg_.train.max_steps;
    // Every token of the global batch gets the same weight: the rank sum of the gradients is
    // the gradient of the mean loss.
    const float grad_scale = 1.0f / (float)((int64_t)B * T * K * cfg_.dp());
    double timed_seconds = 0;
    int64_t timed_steps = 0;
    PhaseTimes timed_phases;  // this rank's, over the timed steps (core/phase_clock.h)
    const SlowdownForTest slow = slowdown_for_test();
    int ran = 0;
    engine_->memory().reset_peak();
    const bool fp16 = cfg_.train.precision == "fp16";
    // The guard's snapshots are scratch: removed however run() ends (the run's own checkpoints
    // are what it leaves).
    struct RemoveOnExit {
        std::string dir;
        ~RemoveOnExit() {
            std::error_code ec;
            if (!dir.empty()) fs::remove_all(dir, ec);
        }
    } guard_scratch{guard_ && root() ? guard_dir() : std::string()};
    if (guard_ && state_.step < total) guard_snapshot();  // the state to go back to at first

    while (state_.step < total) {
        if (opts_.stop_after >= 0 && ran >= opts_.stop_after) break;
        if (opts_.before_step) opts_.before_step(state_.step + 1, *engine_);
        // A batch the guard found bad is read past, on every pass over it (a replay included).
        while (std::find(skipped_batches_.begin(), skipped_batches_.end(),
                         train_loader_->position()) != skipped_batches_.end()) {
            const data::DataLoader::Position p = train_loader_->position();
            for (int k = 0; k < K; k++) next_rows(*train_loader_);
            print(fmt::format("guard: step {} reads past the batch at epoch {}, window {}\n",
                              state_.step + 1, p.epoch, p.cursor));
        }
        const data::DataLoader::Position batch_at = train_loader_->position();
        auto t0 = std::chrono::steady_clock::now();
        const PhaseTimes phases_at_t0 = phase_clock().totals();
        double lr = lr_at(cfg_.optim, peak_lr_, state_.step, total);
        if (guard_) lr *= guard_->lr_scale(state_.step + 1);
        if (opts_.on_lr) lr = opts_.on_lr(state_.step + 1, lr);
        if (!std::isfinite(lr))  // (validate_config refuses non-finite keys; a product may not be)
            fail(
                "the learning rate at step {} is {} (optim.lr = {}, scaled peak {}): refusing "
                "to update with it",
                state_.step + 1, lr, cfg_.optim.lr, peak_lr_);
        engine_->prepare_update(lr, cfg_.optim.grad_clip);
        engine_->begin_step();
        const bool amp_step =
            cfg_.train.diagnostics == "amp" &&
            ((state_.step + 1) % cfg_.train.diagnostics_every == 0 || state_.step == first_step);
        if (amp_step) engine_->record_activation_histograms();
        for (int k = 0; k < K; k++) {
            {
                const ScopedPhase data(Phase::data);
                next_rows(*train_loader_);
                if (slow.data_ms > 0)
                    std::this_thread::sleep_for(std::chrono::milliseconds(slow.data_ms));
            }
            if (opts_.on_batch) opts_.on_batch(state_.step + 1, xg_.data(), yg_.data(), xg_.size());
            // Dropout masks follow the sequence: its ordinal over the run's global micro-batches
            // (a replayed step draws the same, and so does any world size).
            engine_->set_dropout_rows(((uint64_t)state_.step * K + k) * (uint64_t)cfg_.dp() * B +
                                      (uint64_t)dp_rank() * B);
            const ScopedPhase compute(Phase::compute);
            if (slow.rank == comm_->rank())
                std::this_thread::sleep_for(std::chrono::milliseconds(slow.rank_ms));
            engine_->forward_backward(xg_.data() + rows, yg_.data() + rows, B, T, grad_scale,
                                      k == K - 1);
        }
        if (amp_step) amp_diagnose(state_.step + 1);
        const StepResult step = [&] {
            const ScopedPhase optimizer(Phase::optimizer);
            return engine_->finish_step(lr, cfg_.optim.grad_clip);
        }();
        const double loss = mean_over_ranks(step.loss);
        const double norm = step.grad_norm;
        // (An fp16 step the loss scaler skipped is the scaler's; a step skipped without one is a
        // non-finite gradient the engine left to the guard.)
        if (guard_ && !(step.skipped && fp16)) {
            const std::string why = guard_->judge(loss, norm);
            if (!why.empty()) {
                guard_rollback(state_.step + 1, why, batch_at, sum);
                continue;
            }
            guard_->accept(state_.step + 1, loss, norm);
        }
        // Without the guard, a non-finite loss or gradient norm (not an fp16 overflow, which the
        // engine skipped): the run stops here, before this step is logged or saved, so no
        // checkpoint ever holds its update; `latest` names the last good one.
        if (!step.skipped && (!std::isfinite(loss) || !std::isfinite(norm))) {
            const bool first = ran == 0 && opts_.resume.empty();
            fail("{} at step {}: loss {}, gradient norm {}; stopping before this step is saved{}",
                 first ? "not finite" : "training diverged", state_.step + 1, loss, norm,
                 first && !cfg_.model.init_from.empty()
                     ? fmt::format(". The first step of the run: check the weights of "
                                   "model.init_from = {} and the data",
                                   cfg_.model.init_from)
                     : fmt::format(" (latest names the last good checkpoint). Lower optim.lr "
                                   "(now {}) or check the data",
                                   cfg_.optim.lr));
        }
        if (step.skipped) sum.steps_skipped++;
        state_.step++;
        ran++;
        auto pos = train_loader_->position();
        state_.data_epoch = pos.epoch;
        state_.data_cursor = pos.cursor;
        double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const PhaseTimes step_phases = phase_clock().totals() - phases_at_t0;
        if (ran > 1) {
            timed_seconds += secs;
            timed_steps++;
            timed_phases += step_phases;
        }
        double tps = (double)cfg_.tokens_per_step() / secs;
        auto mem = engine_->memory().snapshot();
        sum.losses.push_back((float)loss);
        // fp16: the loss scale this step's gradients carried, and whether an overflow skipped it.
        const std::string scale =
            fp16 ? fmt::format(
                       " | scale {:g}{}", step.loss_scale,
                       step.skipped ? " (overflow: update skipped; " + step.overflow + ")" : "")
                 : std::string();
        // Elapsed in this process, and the rest at its mean step time so far.
        const double elapsed =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
        const double eta =
            elapsed / (double)(state_.step - first_step) * (double)(total - state_.step);
        if (state_.step % cfg_.train.log_every == 0 || state_.step == total || step.skipped)
            print(fmt::format(
                "step {:>5}/{} | loss {:.4f} | lr {:.2e} | norm {:.3f} | {:>8.0f} tok/s | {:>7.1f} "
                "ms | mem {} / peak {} | {}{}{}\n",
                state_.step, total, loss, lr, norm, tps, secs * 1000, mib(mem.total_used),
                mib(mem.peak_total_used), short_duration(elapsed),
                state_.step < total ? ", eta " + short_duration(eta) : std::string(), scale));
        if (metrics_)
            log_metrics(fmt::format(
                "{{\"step\": {}, \"loss\": {:.6f}, \"lr\": {:.6e}, \"grad_norm\": {:.6f}, "
                "\"tokens_per_s\": {:.1f}, \"ms_per_step\": {:.3f}, \"mem_bytes\": {}, "
                "\"peak_mem_bytes\": {}, \"time\": {:.3f}{}, \"phases_ms\": {{{}}}{}}}",
                state_.step, loss, lr, norm, tps, secs * 1000, mem.total_used, mem.peak_total_used,
                std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
                    .count(),
                io::metrics_memory_field(mem), phases_field(step_phases),
                fp16 ? fmt::format(
                           ", \"loss_scale\": {:g}, \"skipped\": {}{}", step.loss_scale,
                           step.skipped,
                           step.skipped ? fmt::format(", \"overflow\": \"{}\"", step.overflow) : "")
                     : std::string()));
        bool last = state_.step == total;
        if (val_loader_ &&
            ((cfg_.train.eval_every > 0 && state_.step % cfg_.train.eval_every == 0) || last)) {
            float vl = evaluate();
            sum.val_losses.push_back({(int)state_.step, vl});
            print(fmt::format("step {:>5}/{} | val loss {:.4f}\n", state_.step, total, vl));
            log_metrics(fmt::format("{{\"step\": {}, \"val_loss\": {:.6f}}}", state_.step, vl));
        }
        // A signal stops every rank after the same step: one tiny all-reduce when there are
        // peers (a handler may have run on some ranks only, or at different steps).
        int64_t stop_sig = opts_.stop_signal ? (int64_t)*opts_.stop_signal : 0;
        if (opts_.stop_signal && comm_->size() > 1) comm_->all_reduce_max(&stop_sig, 1);
        if (stop_sig != 0 && !last) sum.stopped_by_signal = (int)stop_sig;
        bool stopping = (opts_.stop_after >= 0 && ran >= opts_.stop_after) || stop_sig != 0;
        if ((cfg_.io.checkpoint_every > 0 && state_.step % cfg_.io.checkpoint_every == 0) ||
            (last && cfg_.io.save_final) || stopping) {
            sum.last_checkpoint = save_state(cfg_.io.out_dir);
            print(fmt::format("checkpoint: {}\n", sum.last_checkpoint));
            if (root()) {
                const std::vector<std::string> removed = prune_checkpoints(
                    cfg_.io.out_dir, cfg_.io.keep_last, cfg_.io.keep_every, state_.step);
                if (!removed.empty())
                    print(fmt::format("checkpoint: removed {} (io.keep_last = {})\n",
                                      fmt::join(removed, ", "), cfg_.io.keep_last));
            }
        }
        if (stop_sig != 0) break;
        if (guard_ && !last && state_.step % cfg_.guard.snapshot_every == 0) guard_snapshot();
    }
    write_timings(timed_steps, timed_seconds, timed_phases);
    sum.steps_done = state_.step;
    sum.tokens_per_s =
        timed_steps ? (double)cfg_.tokens_per_step() * timed_steps / timed_seconds : 0;
    if (metrics_failed_at_)  // said once when it happened; again where the run ends
        std::fprintf(stderr, "memtrain: warning: %s holds steps up to %lld only (%s)\n",
                     metrics_->path().c_str(), (long long)metrics_failed_at_ - 1,
                     metrics_->error().c_str());
    metrics_.reset();
    if (root()) {  // for `memtrain report`: measured peaks beside the predictions
        try {
            write_memory_json(plan_, *engine_, (fs::path(cfg_.io.out_dir) / "memory.json").string(),
                              /*plan_rows=*/!opts_.engine);
        } catch (const Error& e) {  // the run itself succeeded; say what the report will lack
            std::fprintf(stderr, "memtrain: warning: memory.json not written: %s\n", e.what());
        }
        try {
            print(engine_->write_run_files(cfg_.io.out_dir));
        } catch (const Error& e) {
            std::fprintf(stderr, "memtrain: warning: %s\n", e.what());
        }
    }
    if (amp_last_step_ > 0) amp_summary();
    if (!opts_.quiet && !sum.stopped_by_signal) {
        print_memory_report();
        print_sample();
    }
    return sum;
}

std::string Trainer::guard_dir() const {
    return (fs::path(cfg_.io.out_dir) / "guard_snapshots").string();
}

std::string Trainer::save_state(const std::string& out_dir) {
    std::tie(state_.loss_scale, state_.loss_scale_clean) = engine_->loss_scaler_state();
    state_.clip_norm = engine_->clip_norm_state();
    return save_checkpoint(out_dir, config_as_written(), engine_->checkpoint_model(),
                           engine_->optimizer(), state_, *comm_);
}

void Trainer::load_state(const std::string& dir) {
    state_ = load_checkpoint(dir, engine_->checkpoint_model(), engine_->optimizer());
    engine_->restore_loss_scaler(state_.loss_scale, state_.loss_scale_clean);
    engine_->restore_clip_norm(state_.clip_norm);
}

void Trainer::guard_snapshot() {
    std::string dir;
    try {
        dir = save_state(guard_dir());
    } catch (const Error& e) {
        // Weights that are not finite after a clean step's update (every rank refuses alike):
        // the next step's loss shows it, and the guard goes back to an older snapshot.
        print(fmt::format("guard: no snapshot at step {}: {}\n", state_.step, e.what()));
        return;
    }
    while (!snapshots_.empty() && snapshots_.back().first >= state_.step) snapshots_.pop_back();
    snapshots_.push_back({state_.step, dir});
    // Two are enough: a rollback from step t goes to the newest snapshot taken at step t - 2 or
    // before (the update of step t - 1 may be the bad one), and snapshots are >= 2 steps apart.
    // The checkpoints' own retention removes the older ones from the disk.
    if (snapshots_.size() > 2) snapshots_.erase(snapshots_.begin(), snapshots_.end() - 2);
    if (root()) prune_checkpoints(guard_dir(), 2, 0, state_.step);
}

void Trainer::guard_rollback(int64_t bad, const std::string& reason,
                             data::DataLoader::Position batch_at, TrainSummary& sum) {
    if (snapshots_.empty())
        fail("training diverged at step {}: {}; the guard holds no snapshot to go back to", bad,
             reason);
    // The newest snapshot from before the step ahead of the bad one, else the oldest.
    auto target = snapshots_.front();
    for (const auto& sn : snapshots_)
        if (sn.first <= bad - 2) target = sn;
    const DivergenceGuard::Action a = guard_->on_anomaly(bad, target.first, reason);
    skipped_batches_.push_back(batch_at);
    load_state(target.second);
    train_loader_->set_position({state_.data_epoch, state_.data_cursor});
    while (snapshots_.back().first > target.first) {
        std::error_code ec;
        if (root()) fs::remove_all(snapshots_.back().second, ec);
        snapshots_.pop_back();
    }
    // What this process trained after the snapshot (steps target + 1 .. bad - 1, the last ones
    // of sum.losses) is run again.
    const int64_t undone = bad - 1 - target.first;
    sum.losses.resize((std::size_t)std::max<int64_t>(0, (int64_t)sum.losses.size() - undone));
    std::erase_if(sum.val_losses, [&](const auto& v) { return v.first > target.first; });
    sum.guard_actions.push_back({bad, target.first, a.lower_lr, reason});
    const std::string lr_note =
        a.lower_lr ? fmt::format(
                         "; a repeat within guard.window = {} steps: learning rate x{:g} "
                         "up to step {}",
                         cfg_.guard.window, a.lr_scale, a.lr_until)
                   : std::string();
    print(fmt::format(
        "guard: step {}: {}. Back to step {} (rollback {} of at most {}), skipping the step's "
        "batch (epoch {}, window {}){}\n",
        bad, reason, target.first, a.rollback, cfg_.guard.max_rollbacks, batch_at.epoch,
        batch_at.cursor, lr_note));
    // `memtrain report` drops the lines logged for steps after to_step (they run again) and
    // marks the loss chart at `step`.
    log_metrics(fmt::format(
        "{{\"step\": {}, \"event\": \"guard\", \"action\": \"{}\", \"to_step\": {}, "
        "\"data_epoch\": {}, \"data_cursor\": {}, \"lr_scale\": {:g}, \"reason\": \"{}\"}}",
        bad, a.lower_lr ? "rollback" : "skip", target.first, batch_at.epoch, batch_at.cursor,
        a.lr_scale, reason));
}

namespace {

std::string pct(double f) {
    return fmt::format("{:.3g}%", 100 * f);
}

}  // namespace

namespace {

// A histogram's counts from its lowest to its highest non-empty exponent.
std::vector<int64_t> histogram_counts(const Log2Histogram& h) {
    std::vector<int64_t> counts;
    for (int e = h.min_exp(); e <= h.max_exp(); e++) counts.push_back(h.at(e));
    return counts;
}

// An amp line's "tensors": each tensor's values, fractions (fp16 at the scale 2^scale_of(name))
// and largest exponent.
template <class ScaleOf>
std::string amp_tensors_json(const std::vector<Engine::TensorHistogram>& hists,
                             ScaleOf&& scale_of) {
    std::string out;
    for (const auto& t : hists) {
        const PrecisionLoss p = precision_loss(t.hist, scale_of(t.name));
        out += fmt::format(
            "{}{{\"name\": \"{}\", \"values\": {}, \"zero\": {:.6g}, \"fp16_underflow\": "
            "{:.6g}, \"fp16_overflow\": {:.6g}, \"max_log2\": {}}}",
            out.empty() ? "" : ", ", t.name, t.hist.total, p.zero, p.fp16_underflow,
            p.fp16_overflow, t.hist.max_exp());
    }
    return out;
}

}  // namespace

void Trainer::amp_diagnose(int64_t step) {
    const std::vector<Engine::TensorHistogram> hists = engine_->gradient_histograms();
    Log2Histogram all;
    for (const auto& t : hists) all.merge(t.hist);
    // The gradients here are unscaled (fp32 or bf16 on the CPU): fp16 would hold them x 2^s.
    const int s = fp16_scale_log2();
    const PrecisionLoss raw = precision_loss(all, 0), scaled = precision_loss(all, s);
    const int safe = largest_safe_scale_log2(all);
    print(fmt::format(
        "amp step {}: {} gradient values, {} zero; fp16 would flush {} to zero unscaled, {} at "
        "loss scale 2^{} (overflowing {}); bf16 flushes {}; the largest scale without overflow is "
        "2^{}\n",
        step, all.total, pct(raw.zero), pct(raw.fp16_underflow), pct(scaled.fp16_underflow), s,
        pct(scaled.fp16_overflow), pct(raw.bf16_underflow), safe));
    const std::string tensors = amp_tensors_json(hists, [&](const std::string&) { return s; });
    // The whole histogram from its lowest to its highest non-empty exponent.
    const int lo = all.min_exp();
    const std::vector<int64_t> counts = histogram_counts(all);
    log_metrics(fmt::format(
        "{{\"step\": {}, \"event\": \"amp\", \"values\": {}, \"zeros\": {}, \"nonfinite\": {}, "
        "\"loss_scale_log2\": {}, \"fp16_underflow_unscaled\": {:.6g}, \"fp16_underflow\": {:.6g}, "
        "\"fp16_overflow\": {:.6g}, \"bf16_underflow\": {:.6g}, \"safe_scale_log2\": {}, "
        "\"log2_lo\": {}, \"log2_counts\": [{}], \"tensors\": [{}]}}",
        step, all.total, all.zeros, all.nonfinite, s, raw.fp16_underflow, scaled.fp16_underflow,
        scaled.fp16_overflow, raw.bf16_underflow, safe, lo, fmt::join(counts, ", "), tensors));
    amp_last_ = all;
    amp_last_step_ = step;
    amp_activations(step, s);
}

void Trainer::amp_activations(int64_t step, int s) {
    // The lecture's Figure 5 is of these: the activation gradients, whose fp16 copies carry the
    // loss scale as the weight gradients do; the activations themselves carry none.
    const std::vector<Engine::TensorHistogram> hists = engine_->activation_histograms();
    if (hists.empty()) return;  // (the CUDA engine counts gradients only)
    Log2Histogram out, grad;
    for (const auto& t : hists) (t.name.ends_with(".grad") ? grad : out).merge(t.hist);
    const PrecisionLoss a = precision_loss(out, 0), g = precision_loss(grad, 0),
                        gs = precision_loss(grad, s);
    print(fmt::format(
        "amp step {}: {} activation values (block outputs), {} zero, largest 2^{}; fp16 would "
        "overflow {}. {} activation gradients (of block inputs), {} zero; fp16 would flush {} to "
        "zero unscaled, {} at loss scale 2^{} (overflowing {}); bf16 flushes {}\n",
        step, out.total, pct(a.zero), out.max_exp(), pct(a.fp16_overflow), grad.total, pct(g.zero),
        pct(g.fp16_underflow), pct(gs.fp16_underflow), s, pct(gs.fp16_overflow),
        pct(g.bf16_underflow)));
    auto histogram = [](const Log2Histogram& h) {
        return fmt::format(
            "\"values\": {}, \"zeros\": {}, \"nonfinite\": {}, \"log2_lo\": {}, "
            "\"log2_counts\": [{}]",
            h.total, h.zeros, h.nonfinite, h.min_exp(), fmt::join(histogram_counts(h), ", "));
    };
    // An activation carries no loss scale; its gradient carries the one fp16 would start at.
    const std::string tensors = amp_tensors_json(
        hists, [&](const std::string& name) { return name.ends_with(".grad") ? s : 0; });
    log_metrics(fmt::format(
        "{{\"step\": {}, \"event\": \"amp_activations\", \"loss_scale_log2\": {}, "
        "\"activations\": {{{}, \"fp16_overflow\": {:.6g}}}, \"activation_grads\": {{{}, "
        "\"fp16_underflow_unscaled\": {:.6g}, \"fp16_underflow\": {:.6g}, \"fp16_overflow\": "
        "{:.6g}, \"bf16_underflow\": {:.6g}}}, \"tensors\": [{}]}}",
        step, s, histogram(out), a.fp16_overflow, histogram(grad), g.fp16_underflow,
        gs.fp16_underflow, gs.fp16_overflow, g.bf16_underflow, tensors));
}

int Trainer::fp16_scale_log2() const {
    return (int)std::lround(std::log2(cfg_.optim.loss_scale));
}

void Trainer::amp_summary() {
    const int s = fp16_scale_log2();
    const int safe = largest_safe_scale_log2(amp_last_);
    const PrecisionLoss at_s = precision_loss(amp_last_, s),
                        at_safe = precision_loss(amp_last_, safe);
    std::string advice;
    if (at_s.fp16_overflow > 0)
        advice = fmt::format(
            "fp16 at optim.loss_scale = 2^{} would overflow {} of them (the dynamic scaler would "
            "halve it down to 2^{} at least, flushing {} to zero)",
            s, pct(at_s.fp16_overflow), safe, pct(at_safe.fp16_underflow));
    else
        advice = fmt::format(
            "fp16 at optim.loss_scale = 2^{} would flush {} of them to zero; at 2^{}, the "
            "largest scale without overflow, {}",
            s, pct(at_s.fp16_underflow), safe, pct(at_safe.fp16_underflow));
    const bool prefer_bf16 = at_safe.fp16_underflow > 0.01;
    print(fmt::format("amp (gradients at step {}): {}; bf16 would flush {}. {}\n", amp_last_step_,
                      advice, pct(precision_loss(amp_last_, 0).bf16_underflow),
                      prefer_bf16 ? "fp16 loses over 1% of the gradients even at its best scale: "
                                    "train in bf16 (train.precision = \"bf16\")"
                                  : fmt::format("fp16 with a loss scale of 2^{} keeps all but {}",
                                                safe, pct(at_safe.fp16_underflow))));
}

void Trainer::print_memory_report() {
    // (A collective: every rank sends its peaks to rank 0.)
    print(memory_report(plan_, *engine_, *comm_, /*plan_rows=*/!opts_.engine));
}

void Trainer::print_sample() {
    if (cfg_.data.tokenizer.empty() || cfg_.sample.max_tokens == 0) return;
    // Under ZeRO-3 every forward gathers parameters, and a pipeline's forward passes through
    // every stage, so every rank generates (the same tokens, from the same RNG state); otherwise
    // rank 0 alone does. Tensor parallelism's every forward runs the group's all-reduces, so
    // there too every rank generates.
    if (!root() && cfg_.train.zero_stage < 3 && cfg_.train.pp == 1 && cfg_.train.tp == 1) return;
    auto tok = data::Tokenizer::load(cfg_.data.tokenizer);
    auto eot = tok.eot_token();
    if (cfg_.sample.prompt.empty() && !eot && !tok.bos_token()) return;
    const std::vector<int32_t> prompt = prompt_tokens(tok, cfg_.sample.prompt);
    Rng rng;
    rng.set_state(state_.rng);
    SampleOptions so;
    so.max_tokens = cfg_.sample.max_tokens;
    so.temperature = cfg_.sample.temperature;
    so.top_k = cfg_.sample.top_k;
    // No stop at end-of-text: a short document would leave an empty sample; the marker shows
    // where the model started a new one.
    so.stop_token = -1;
    auto out = generate(
        cfg_.model,
        [&](const int32_t* x, int T, float* logits) { engine_->forward_logits(x, 1, T, logits); },
        prompt, so, rng);
    std::vector<uint32_t> ids(out.begin(), out.end());
    print(fmt::format("\nsample ({}):\n{}{}\n",
                      so.temperature == 0
                          ? std::string("greedy")
                          : fmt::format("temperature {}, top-k {}", so.temperature, so.top_k),
                      cfg_.sample.prompt, tok.decode(ids)));
}

CpuEngine& Trainer::cpu_engine() {
    auto* e = dynamic_cast<CpuEngine*>(engine_.get());
    if (!e) fail("internal: the trainer runs on {}, not the CPU engine", engine_->describe());
    return *e;
}

GPT& Trainer::model() {
    return cpu_engine().model();
}

dist::ZeroStore& Trainer::store() {
    return cpu_engine().zero_store();
}

}  // namespace memtrain
