// `memtrain train CONFIG [--set section.key=value ...] [--resume DIR]`
// Under mpirun (or srun) every process runs this command; they form one data-parallel job.
#include <chrono>
#include <cstdio>
#include <thread>

#include "cli/commands.h"
#include "core/error.h"
#include "dist/mpi_communicator.h"
#include "train/trainer.h"

namespace memtrain::cli {

void register_train(CLI::App& app) {
    auto* cmd = app.add_subcommand("train", "train a GPT from a TOML config");
    struct Args {
        std::string config;
        std::vector<std::string> sets;
        std::string resume;
        bool keys = false;
        int stop_after = -1;
    };
    auto args = std::make_shared<Args>();
    cmd->add_option("config", args->config, "TOML config (e.g. configs/demo.toml)");
    cmd->add_option("--set", args->sets, "override a key: section.key=value (repeatable)")
        ->take_all();
    cmd->add_option("--resume", args->resume,
                    "continue from a checkpoint directory (or an out_dir with `latest`)");
    cmd->add_option("--stop-after", args->stop_after,
                    "stop (and checkpoint) after this many steps of this run");
    cmd->add_flag("--help-keys", args->keys, "list every config key and exit");
    cmd->callback([args]() {
        if (args->keys) {
            for (const auto& k : config_keys()) std::printf("%s\n", k.c_str());
            return;
        }
        TrainOptions opts;
        opts.resume = args->resume;
        opts.stop_after = args->stop_after;
        if (!dist::launched_by_mpi()) {
            Trainer trainer(load_run_config(args->config, args->sets), opts);
            trainer.run();
            return;
        }
        dist::MpiCommunicator comm;
        try {
            Trainer trainer(load_run_config(args->config, args->sets), opts, &comm);
            trainer.run();
        } catch (const Error& e) {
            if (comm.size() == 1) throw;
            // The other ranks may be waiting in a collective for this one: end the whole job
            // now. Errors every rank meets together (a bad config, configs that differ) are
            // printed by each before the first abort lands.
            std::fprintf(stderr, "memtrain: rank %d of %d: error: %s\n", comm.rank(), comm.size(),
                         e.what());
            std::fflush(stderr);
            std::this_thread::sleep_for(std::chrono::milliseconds(500));
            comm.abort(e.what());
        }
    });
}

}  // namespace memtrain::cli
