// `memtrain train [CONFIG] [--set section.key=value ...] [--resume DIR] [--print-config]`
// Under mpirun (or srun) every process runs this command; they form one data-parallel job.
// SIGINT/SIGTERM/SIGUSR1 stop training cleanly: the step finishes, a checkpoint is written
// (docs/training.md).
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "cli/commands.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "train/plan.h"
#include "train/trainer.h"
#include "train/validate.h"

namespace memtrain::cli {

// Async-signal-safe state: the first signal's number, and the line the handler writes (formatted
// before the handler is installed; only rank 0 writes it, so a job-wide signal prints once).
volatile std::sig_atomic_t g_stop_signal = 0;  // (commands.h)
static char g_notice[160];
static std::size_t g_notice_len = 0;

extern "C" void on_stop_signal(int sig) {
    if (g_stop_signal != 0) {
        // The second signal ends the process now, by that signal's default action. Checkpoints
        // are written under a temporary name and renamed, so none is left half-written.
        std::signal(sig, SIG_DFL);
        std::raise(sig);
        return;
    }
    g_stop_signal = sig;
    if (g_notice_len) (void)!::write(STDERR_FILENO, g_notice, g_notice_len);
}

void install_stop_handlers(bool announce) {
    const char msg[] =
        "\nmemtrain: signal received: finishing this step, then saving a checkpoint "
        "(signal again to stop at once, without one)\n";
    static_assert(sizeof msg <= sizeof g_notice);
    std::memcpy(g_notice, msg, sizeof msg - 1);
    g_notice_len = announce ? sizeof msg - 1 : 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // file and socket calls carry on rather than fail with EINTR
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    // OpenMPI's mpirun forwards SIGUSR1 to every rank (a SIGTERM of its own it turns into a kill
    // of the job): `kill -USR1 <mpirun>` stops an mpirun job cleanly.
    sigaction(SIGUSR1, &sa, nullptr);
}

const char* signal_name(int sig) {
    switch (sig) {
        case SIGINT:
            return "SIGINT";
        case SIGTERM:
            return "SIGTERM";
        case SIGUSR1:
            return "SIGUSR1";
        default:
            return "a signal";
    }
}

namespace {

// The config: the defaults, or with --resume the checkpoint's own saved config (its io.out_dir
// the directory the checkpoint is in); then CONFIG; then each --set.
RunConfig make_config(const std::string& config, const std::vector<std::string>& sets,
                      const std::string& resume) {
    if (config.empty() && resume.empty() && sets.empty())
        fail(
            "memtrain train needs a CONFIG, a TOML file (e.g. configs/demo.toml), or --resume DIR "
            "to continue a run from its checkpoint");
    if (resume.empty()) return load_run_config(config, sets);
    std::string note;  // (a fallback from a dangling `latest`: the Trainer says it)
    const std::string dir = resolve_checkpoint_dir(resume, &note);
    RunConfig base = checkpoint_config(dir);
    const auto parent = std::filesystem::path(dir).parent_path();
    base.io.out_dir = parent.empty() ? std::string(".") : parent.string();  // (--resume ckpt_5)
    return load_run_config(config, sets, &base);
}

// What `memtrain train` would train: nothing when a resumed run is already at train.max_steps,
// with --stop-after 0, or with train.max_steps = 0. Then it says so (the line returned) and
// touches no file: a finished run's checkpoints, metrics and memory.json stay as they are.
std::optional<std::string> nothing_to_train(const RunConfig& cfg, const std::string& resume,
                                            int stop_after) {
    const int64_t max_steps = cfg.train.max_steps;
    int64_t at = 0;
    bool continuing = false;  // the checkpoint's own run, in its out_dir (not a fork elsewhere)
    if (!resume.empty()) {
        const std::string dir = resolve_checkpoint_dir(resume);
        at = checkpoint_state(dir).step;
        continuing = resumes_in_place(dir, cfg.io.out_dir);
    }
    const std::string cmd =
        resume.empty() ? "memtrain train CONFIG" : "memtrain train --resume " + resume;
    if (continuing && at >= max_steps)
        return fmt::format(
            "the run in {} is already complete at step {} (train.max_steps = {}): nothing to "
            "train, no file changed. To train longer: {} --set train.max_steps={}",
            cfg.io.out_dir, at, max_steps, cmd, std::max<int64_t>(2 * at, at + 1));
    if (max_steps == 0)
        return fmt::format(
            "train.max_steps = 0: nothing to train, no file changed. Set train.max_steps to the "
            "number of optimizer steps to run (e.g. --set train.max_steps=1000)");
    if (stop_after == 0)
        return fmt::format(
            "--stop-after 0: nothing to train (the run stays at step {}), no file "
            "changed",
            at);
    return std::nullopt;
}

// 64-bit FNV-1a: the same error text gives the same number on every rank.
uint64_t text_hash(const std::string& s) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    return h;
}

// Start-up errors (the config, io.out_dir) usually hit every rank alike. The ranks compare theirs
// before any training collective: an error every rank met is printed once, by rank 0, and one
// only some met by those ranks with their rank; then all exit together (no abort, no timeout).
void agree_on_startup(dist::Communicator& comm, const std::string& error) {
    struct Status {
        int64_t failed;
        uint64_t hash;
    } mine{error.empty() ? 0 : 1, text_hash(error)};
    std::vector<Status> all((std::size_t)comm.size());
    comm.all_gather_bytes(&mine, all.data(), sizeof(Status));
    int failed = 0;
    bool same = true;
    for (const auto& s : all) {
        failed += (int)s.failed;
        same = same && s.failed && s.hash == all[0].hash;
    }
    if (failed == 0) return;
    if (same) {
        if (comm.rank() == 0) std::fprintf(stderr, "memtrain: error: %s\n", error.c_str());
    } else if (!error.empty()) {
        std::fprintf(stderr, "memtrain: rank %d of %d: error: %s\n", comm.rank(), comm.size(),
                     error.c_str());
    } else if (comm.rank() == 0) {
        std::fprintf(stderr, "memtrain: %d of %d ranks failed to start (each prints its error)\n",
                     failed, comm.size());
    }
    std::fflush(stderr);
    throw ExitCode{1};
}

// After a signal stopped the run: what happened and how to go on, from rank 0; the exit code
// 128 + signal, what a shell reports for a process that signal ended (docs/training.md).
[[noreturn]] void stopped(const TrainSummary& sum, const RunConfig& cfg, int rank, int world) {
    if (rank == 0) {
        std::fprintf(stderr,
                     "memtrain: stopped by %s after step %lld of %d; checkpoint: %s\n"
                     "memtrain: to continue: %smemtrain train --resume %s\n",
                     signal_name(sum.stopped_by_signal), (long long)sum.steps_done,
                     cfg.train.max_steps, sum.last_checkpoint.c_str(),
                     world > 1 ? fmt::format("mpirun -np {} ", world).c_str() : "",
                     cfg.io.out_dir.c_str());
        std::fflush(stderr);
    }
    throw ExitCode{128 + sum.stopped_by_signal};
}

}  // namespace

void register_train(CLI::App& app) {
    auto* cmd = app.add_subcommand("train", "train a GPT from a TOML config");
    struct Args {
        std::string config;
        std::vector<std::string> sets;
        std::string resume;
        bool keys = false;
        bool print_config = false;
        bool print_plan = false;
        int stop_after = -1;
        bool overwrite = false;
        bool accept_changes = false;
        bool reset_data = false;
    };
    auto args = std::make_shared<Args>();
    cmd->add_option("config", args->config,
                    "TOML config (e.g. configs/demo.toml); optional with --resume, whose "
                    "checkpoint holds the run's config");
    cmd->add_option("--set", args->sets, "override a key: section.key=value (repeatable)")
        ->take_all();
    cmd->add_option("--resume", args->resume,
                    "continue from a checkpoint directory (or an out_dir with `latest`), with "
                    "the config saved in it; CONFIG and --set, if given, override its keys");
    cmd->add_option("--stop-after", args->stop_after,
                    "stop (and checkpoint) after this many steps of this run (0: train nothing)")
        ->check(CLI::NonNegativeNumber);
    cmd->add_flag("--overwrite", args->overwrite,
                  "replace the run io.out_dir holds (its checkpoints, latest and metrics are "
                  "removed first); without it a new run there is refused");
    cmd->add_flag("--accept-changes", args->accept_changes,
                  "with --resume: continue although data.train, the tokenizer, train.seq_len, "
                  "train.batch_size, train.seed or the model's norm_eps / rope_theta changed "
                  "(printed); without it such a resume is refused");
    cmd->add_flag("--reset-data", args->reset_data,
                  "with --resume: read data.train from its start (a new shard, say: --set "
                  "data.train=new.bin), keeping the weights, optimizer state, step and schedule");
    cmd->add_flag("--help-keys", args->keys, "list every config key and exit");
    cmd->add_flag("--print-config", args->print_config,
                  "print the resolved config as TOML (every key) and exit without training");
    cmd->add_flag("--print-plan", args->print_plan,
                  "print the run plan (engine, mesh, placements, precision, remat, this rank's "
                  "predicted memory) and exit without allocating (under mpirun: rank 0's)");
    cmd->callback([args]() {
        if (args->keys) {
            for (const auto& k : config_keys()) std::printf("%s\n", k.c_str());
            return;
        }
        if (args->print_config) {
            const RunConfig cfg = make_config(args->config, args->sets, args->resume);
            // The checks training makes once "auto" is resolved here (bf16 asked of a machine
            // whose device is the CPU): the config printed is one that would start.
            RunConfig resolved = cfg;
            resolve_config(resolved);
            resolved.world = resolved.min_world();
            validate_config(resolved);
            std::fputs(to_toml(cfg).c_str(), stdout);
            return;
        }
        if (args->print_plan) {
            std::unique_ptr<dist::Communicator> comm;
            if (dist::launched_by_mpi())
                comm = std::make_unique<dist::MpiCommunicator>();
            else
                comm = std::make_unique<dist::LocalCommunicator>();
            RunConfig cfg = make_config(args->config, args->sets, args->resume);
            cfg.world = comm->size();
            validate_config(cfg);
            RunConfig resolved = cfg;
            resolve_config(resolved);
            const std::string chosen = resolve_micro_batch(resolved, *comm);
            if (!chosen.empty() && comm->rank() == 0) std::printf("%s\n", chosen.c_str());
            if (resolved.train.micro_batch_size != TrainConfig::kAutoMicroBatch)
                cfg.train.micro_batch_size = resolved.train.micro_batch_size;
            const RunPlan plan = plan_run(cfg, *comm);
            if (comm->rank() == 0)
                std::fputs(("plan: " + plan.describe() + "\n" + plan.table()).c_str(), stdout);
            return;
        }
        TrainOptions opts;
        opts.resume = args->resume;
        opts.stop_after = args->stop_after;
        opts.stop_signal = &g_stop_signal;
        opts.refuse_existing_run = true;
        opts.overwrite = args->overwrite;
        opts.accept_changes = args->accept_changes;
        opts.reset_data = args->reset_data;
        if (args->reset_data && args->resume.empty())
            fail("--reset-data needs --resume: a new run reads its data from the start anyway");
        if (!dist::launched_by_mpi()) {
            RunConfig cfg = make_config(args->config, args->sets, args->resume);
            if (auto nothing = nothing_to_train(cfg, args->resume, args->stop_after)) {
                std::printf("memtrain: %s\n", nothing->c_str());
                return;
            }
            install_stop_handlers(true);
            Trainer trainer(std::move(cfg), opts);
            const TrainSummary sum = trainer.run();
            if (sum.stopped_by_signal) stopped(sum, trainer.config(), 0, 1);
            return;
        }
        dist::MpiCommunicator comm;
        install_stop_handlers(comm.rank() == 0);
        std::optional<RunConfig> cfg;
        std::string error;
        try {
            cfg = make_config(args->config, args->sets, args->resume);
            cfg->world = comm.size();
            validate_config(*cfg);
            // Every rank reads the same checkpoint: all return here together, or none does.
            if (auto nothing = nothing_to_train(*cfg, args->resume, args->stop_after)) {
                if (comm.rank() == 0) std::printf("memtrain: %s\n", nothing->c_str());
                return;
            }
            check_out_dir(cfg->io.out_dir, comm.rank());
        } catch (const Error& e) {
            error = e.what();
        }
        if (comm.size() > 1) {
            agree_on_startup(comm, error);
            // Configs that differ between ranks (other working directories, environments) fail
            // on every rank alike: printed once too. The Trainer checks again (cheap).
            try {
                dist::check_same_config(comm, to_toml(*cfg) + "\nresume = " + args->resume);
            } catch (const Error& e) {
                error = e.what();
            }
            agree_on_startup(comm, error);
        }
        try {
            if (!error.empty()) fail("{}", error);
            Trainer trainer(std::move(*cfg), opts, &comm);
            const TrainSummary sum = trainer.run();
            if (sum.stopped_by_signal) stopped(sum, trainer.config(), comm.rank(), comm.size());
        } catch (const Error& e) {
            if (comm.size() == 1) throw;
            // The other ranks may be waiting in a collective for this one: end the whole job
            // now. An error every rank meets together is printed by each before the first abort
            // lands (the start-up errors, printed once, were handled above).
            std::fprintf(stderr, "memtrain: rank %d of %d: error: %s\n", comm.rank(), comm.size(),
                         e.what());
            std::fflush(stderr);
            std::this_thread::sleep_for(std::chrono::milliseconds(500));
            comm.abort(e.what());
        }
    });
}

}  // namespace memtrain::cli
