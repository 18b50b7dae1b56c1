// Entry point of the `memtrain` command: dispatches to the subcommands in cli/.
// Every memtrain::Error becomes one line on stderr and exit code 1; CLI usage errors exit 2.
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "core/error.h"

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
    memtrain::cli::register_quantize(app);
    memtrain::cli::register_lora(app);
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
