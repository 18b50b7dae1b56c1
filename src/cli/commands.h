// Each subcommand of the `memtrain` tool registers itself on the CLI11 app.
// A subcommand parses its arguments, calls the library, and prints; nothing else lives in cli/.
#pragma once

#include <csignal>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace memtrain::cli {

// Thrown to end the command with this exit status, its message (if any) already printed.
struct ExitCode {
    int code;
};

void register_train(CLI::App& app);     // memtrain train CONFIG [--set k=v] [--resume DIR]
void register_sample(CLI::App& app);    // memtrain sample MODEL --prompt ...
void register_eval(CLI::App& app);      // memtrain eval MODEL --data SHARD
void register_tokenize(CLI::App& app);  // memtrain tokenize, memtrain tokenizer train|encode
void register_plan(CLI::App& app);      // memtrain estimate | plan | scale
void register_pipeline(CLI::App& app);  // memtrain pipeline CONFIG --pp P --micro-batches M
void register_remat(CLI::App& app);     // memtrain remat CONFIG [--budget X | --frontier]
void register_report(CLI::App& app);    // memtrain report RUN_DIR [--out FILE]
void register_diagnose(CLI::App& app);  // memtrain diagnose RUN_DIR [--baseline DIR] [--json]
void register_quantize(CLI::App& app);  // memtrain quantize MODEL --method M --bits B --out DIR
void register_lora(CLI::App& app);      // memtrain lora merge CKPT --out DIR
void register_sweep(CLI::App& app);     // memtrain sweep CONFIG --flops C1,... --sizes LxW,...

// `memtrain scale --fit RUN_DIR...` (sweep_cmd.cpp): fits L(N, D) to the runs and recommends
// N and D for `flops` (0: the largest budget among the runs).
void scale_fit(const std::vector<std::string>& run_dirs, double flops, bool json);

// Clean stops on SIGINT, SIGTERM and SIGUSR1 (train_cmd.cpp): the first signal sets
// g_stop_signal (TrainOptions::stop_signal) and, with `announce`, says so on stderr; a second
// one ends the process at once.
extern volatile std::sig_atomic_t g_stop_signal;
void install_stop_handlers(bool announce);
const char* signal_name(int sig);

}  // namespace memtrain::cli
