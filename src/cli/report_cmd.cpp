// `memtrain report RUN_DIR [--out FILE]`: one self-contained HTML page of a run (loss, learning
// rate, gradient norm, throughput, memory over time and against the prediction, config).
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "io/run_report.h"

namespace memtrain::cli {

void register_report(CLI::App& app) {
    auto* cmd = app.add_subcommand("report", "write an HTML report of a training run's out_dir");
    struct Args {
        std::string run_dir, out;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("run_dir", a->run_dir, "the run's out_dir (holds metrics.jsonl)")->required();
    cmd->add_option("--out", a->out, "output HTML file (default: RUN_DIR/report.html)");
    cmd->callback([a]() {
        std::string note;
        const std::string path = io::write_run_report(a->run_dir, a->out, &note);
        if (!note.empty()) std::fprintf(stderr, "memtrain: note: %s\n", note.c_str());
        std::printf("wrote %s\n", path.c_str());
    });
}

}  // namespace memtrain::cli
