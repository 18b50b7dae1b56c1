// A CPU run that cannot fit the host is refused before anything is allocated, naming what it
// needs per category and what would fit; the up-front prediction is what the engine reports.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "cli/cli_util.h"
#include "core/error.h"
#include "engine/host_memory.h"
#include "test_util.h"
#include "train/trainer.h"

using namespace memtrain;
namespace fs = std::filesystem;

namespace {

// Sets MEMTRAIN_HOST_MEMORY for the scope.
struct HostMemory {
    explicit HostMemory(const char* v) { setenv("MEMTRAIN_HOST_MEMORY", v, 1); }
    ~HostMemory() { unsetenv("MEMTRAIN_HOST_MEMORY"); }
};

}  // namespace

TEST(HostFit, PredictionBeforeAllocationIsWhatTheEngineReports) {
    const std::string dir = test::temp_dir("host_fit_same");
    for (bool lora : {false, true}) {
        RunConfig c = test::tiny_run(dir, 1);
        c.train.remat = "selective";
        if (lora) {
            c.lora.rank = 2;
            c.lora.dropout = 0.1;
        }
        TrainOptions o;
        o.quiet = true;
        Trainer t(c, o);
        const auto engine = t.engine().predicted_memory(c.micro_batch(), c.train.seq_len);
        const auto before = predict_cpu_memory(t.config(), t.engine().remat_plan(), 0,
                                               c.micro_batch(), c.train.seq_len);
        ASSERT_EQ(engine.size(), before.size());
        for (std::size_t i = 0; i < engine.size(); i++) {
            EXPECT_EQ(engine[i].bytes, before[i].bytes) << lora << " " << engine[i].formula;
            EXPECT_EQ(engine[i].formula, before[i].formula);
        }
    }
}

TEST(HostFit, ARunThatCannotFitIsRefusedBeforeAllocating) {
    const std::string dir = test::temp_dir("host_fit_refused");
    RunConfig c = test::tiny_run(dir, 1);
    HostMemory small("64KiB");
    const MemoryStats before = host_memory().snapshot();
    try {
        TrainOptions o;
        o.quiet = true;
        Trainer t(c, o);
        ADD_FAILURE() << "a run of more than 64 KiB was accepted";
    } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("host memory per rank"), std::string::npos) << m;
        EXPECT_NE(m.find("parameters"), std::string::npos) << m;
        EXPECT_NE(m.find("activations"), std::string::npos) << m;
        EXPECT_NE(m.find("MEMTRAIN_HOST_MEMORY"), std::string::npos) << m;
        EXPECT_NE(m.find("train.micro_batch_size = 1"), std::string::npos) << m;
    }
    EXPECT_EQ(host_memory().snapshot().total_used, before.total_used) << "something was allocated";
    EXPECT_FALSE(fs::exists(c.io.out_dir + "/metrics.jsonl"));
}

TEST(HostFit, AHugeModelFromTheCommandLineIsOneLine) {
    // 100000 blocks of the demo model: terabytes. Refused at once, not by std::bad_alloc.
    const std::string dir = test::temp_dir("host_fit_cli");
    test::tiny_run(dir, 1);
    auto r = test::run_memtrain("train --set data.train=" + dir +
                                "/train.bin model.vocab_size=50 model.n_layer=100000 "
                                "model.n_embd=384 model.n_head=6 train.device=cpu io.out_dir=" +
                                dir + "/out");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("this run needs"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("it would fail while allocating"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("bad_alloc"), std::string::npos) << r.output;
}

// LoRA and QLoRA: the frozen base (fp32, or packed), the adapters' states and the arenas are
// priced before anything is allocated, and a run they do not fit is refused naming them.
TEST(HostFit, ALoraRunThatCannotFitIsRefusedBeforeAllocating) {
    // The error building a Trainer for `c` gives ("" if it is built).
    auto refusal = [](const RunConfig& c) -> std::string {
        try {
            Trainer t(c, test::quiet());
        } catch (const Error& e) {
            return e.what();
        }
        return "";
    };
    for (const char* base : {"fp32", "nf4"}) {
        RunConfig c = test::tiny_run(test::temp_dir(std::string("host_fit_lora_") + base), 1);
        c.model.n_embd = 32;  // nf4 groups of 32 divide every block matrix's inputs
        c.lora.rank = 4;
        c.lora.base = base;
        c.lora.base_group = 32;
        HostMemory small("64KiB");
        const std::size_t before = host_memory().snapshot().total_used;
        const std::string m = refusal(c);
        EXPECT_EQ(host_memory().snapshot().total_used, before) << base << ": allocated";
        for (const char* word : {"host memory per rank", "parameters", "activations",
                                 "MEMTRAIN_HOST_MEMORY", "a smaller model or more memory"})
            EXPECT_NE(m.find(word), std::string::npos) << base << ": " << m;
    }
}
