// `memtrain diagnose RUN_DIR [--baseline RUN_DIR] [--json]`: where a run's step time went, the
// largest loss and what would recover it, and against a baseline what grew (train/diagnose.h).
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "train/diagnose.h"

namespace memtrain::cli {

void register_diagnose(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "diagnose", "explain a finished run's step time (and memory) against its plan");
    struct Args {
        std::string run_dir, baseline;
        bool json = false;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("run_dir", a->run_dir, "the run's out_dir (holds timings.json)")->required();
    cmd->add_option("--baseline", a->baseline,
                    "another run (another scale) to compare with: names what grew");
    cmd->add_flag("--json", a->json, "print JSON instead of text");
    cmd->callback([a]() {
        const Diagnosis d = diagnose_run(a->run_dir, a->baseline);
        const std::string out = a->json ? diagnosis_json(d) : diagnosis_text(d);
        std::fputs(out.c_str(), stdout);
    });
}

}  // namespace memtrain::cli
