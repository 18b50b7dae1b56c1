// Entry point of the `memtrain` command: dispatches to the subcommands in cli/.
// Every memtrain::Error becomes one line on stderr and exit code 1; CLI usage errors exit 2.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "planner/nearest.h"

#ifndef MEMTRAIN_VERSION
#define MEMTRAIN_VERSION "0.0.0"
#endif
#ifndef MEMTRAIN_GIT_HASH
#define MEMTRAIN_GIT_HASH "unknown"
#endif
#ifndef MEMTRAIN_BUILD_TYPE
#define MEMTRAIN_BUILD_TYPE "unknown"
#endif

int main(int argc, char** argv) {
    CLI::App app{"memtrain: train transformer language models when memory is the limit"};
    // The commit is the one CMake configured from (re-run cmake to refresh it).
    app.set_version_flag("--version", "memtrain " MEMTRAIN_VERSION " (git " MEMTRAIN_GIT_HASH
                                      ", " MEMTRAIN_BUILD_TYPE ", CUDA " +
                                          std::string(MEMTRAIN_HAVE_CUDA ? "on" : "off") + ")");
    app.require_subcommand(1);
    memtrain::cli::register_train(app);
    memtrain::cli::register_sample(app);
    memtrain::cli::register_eval(app);
    memtrain::cli::register_tokenize(app);
    memtrain::cli::register_plan(app);
    memtrain::cli::register_remat(app);
    memtrain::cli::register_pipeline(app);
    memtrain::cli::register_report(app);
    memtrain::cli::register_diagnose(app);
    memtrain::cli::register_quantize(app);
    memtrain::cli::register_lora(app);
    memtrain::cli::register_sweep(app);
    // `memtrain trian`: name the command meant (CLI11 says only that the word was not expected).
    if (argc > 1 && argv[1][0] != '-') {
        std::vector<std::string> names;
        for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
            names.push_back(sub->get_name());
        if (std::find(names.begin(), names.end(), argv[1]) == names.end()) {
            std::fprintf(stderr,
                         "memtrain: error: unknown command '%s'; did you mean %s? (memtrain "
                         "--help lists the commands)\n",
                         argv[1], memtrain::plan::did_you_mean(argv[1], names).c_str());
            return 2;
        }
    }
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e) == 0 ? 0 : 2;
    } catch (const memtrain::cli::ExitCode& e) {
        return e.code;
    } catch (const memtrain::Error& e) {
        std::fprintf(stderr, "memtrain: error: %s\n", e.what());
        return 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "memtrain: internal error: %s\n", e.what());
        return 3;
    }
    return 0;
}
