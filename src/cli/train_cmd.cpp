// `memtrain train CONFIG [--set section.key=value ...] [--resume DIR]`
#include <cstdio>

#include "cli/commands.h"
#include "train/trainer.h"

namespace memtrain::cli {

void register_train(CLI::App& app) {
    auto* cmd = app.add_subcommand("train", "train a GPT from a TOML config");
    struct Args {
        std::string config;
        std::vector<std::string> sets;
        std::string resume;
        bool keys = false;
    };
    auto args = std::make_shared<Args>();
    cmd->add_option("config", args->config, "TOML config (e.g. configs/demo.toml)");
    cmd->add_option("--set", args->sets, "override a key: section.key=value (repeatable)")
        ->take_all();
    cmd->add_option("--resume", args->resume,
                    "continue from a checkpoint directory (or an out_dir with `latest`)");
    cmd->add_flag("--help-keys", args->keys, "list every config key and exit");
    cmd->callback([args]() {
        if (args->keys) {
            for (const auto& k : config_keys()) std::printf("%s\n", k.c_str());
            return;
        }
        RunConfig cfg = load_run_config(args->config, args->sets);
        TrainOptions opts;
        opts.resume = args->resume;
        Trainer trainer(std::move(cfg), opts);
        trainer.run();
    });
}

}  // namespace memtrain::cli
