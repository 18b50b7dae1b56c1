// Entry point of the `memtrain` command: dispatches to the subcommands in cli/.
// Every memtrain::Error becomes one line on stderr and exit code 1; CLI usage errors exit 2.
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
    CLI::App app{"memtrain: train transformer language models when memory is the limit"};
    app.require_subcommand(1);
    memtrain::cli::register_train(app);
    memtrain::cli::register_sample(app);
    memtrain::cli::register_eval(app);
    memtrain::cli::register_tokenize(app);
    memtrain::cli::register_plan(app);
    memtrain::cli::register_remat(app);
    memtrain::cli::register_quantize(app);
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e) == 0 ? 0 : 2;
    } catch (const memtrain::Error& e) {
        std::fprintf(stderr, "memtrain: error: %s\n", e.what());
        return 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "memtrain: internal error: %s\n", e.what());
        return 3;
    }
    return 0;
}
