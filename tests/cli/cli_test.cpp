// End-to-end through the `memtrain` binary: text -> tokenizer -> shards -> train -> checkpoint
// -> sample, and bad input at each step giving one clear line and a non-zero exit.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "cli/cli_util.h"
#include "data/tokenizer.h"
#include "io/checkpoint.h"
#include "io/hf_weights.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

using memtrain::test::run_memtrain;
using memtrain::test::small_corpus;
using memtrain::test::write_file;

}  // namespace

TEST(Cli, EndToEndTokenizeTrainSample) {
    auto dir = memtrain::test::temp_dir("cli_e2e");
    write_file(dir + "/corpus.txt", small_corpus());
    auto r = run_memtrain("tokenizer train --vocab-size 320 --doc-separator % --out " + dir +
                          "/tok.json " + dir + "/corpus.txt");
    ASSERT_EQ(r.code, 0) << r.output;
    r = run_memtrain("tokenize --tokenizer " + dir + "/tok.json --out " + dir +
                     " --doc-separator % --val-fraction 0.1 " + dir + "/corpus.txt");
    ASSERT_EQ(r.code, 0) << r.output;
    ASSERT_TRUE(fs::exists(dir + "/train.bin"));
    ASSERT_TRUE(fs::exists(dir + "/val.bin"));
    write_file(dir + "/run.toml",
               "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32\nvocab_size = 320\n"
               "[train]\nseq_len = 32\nbatch_size = 4\nmicro_batch_size = 2\nmax_steps = 6\n"
               "eval_every = 3\neval_batches = 1\n"
               "[data]\ntrain = \"train.bin\"\nval = \"val.bin\"\ntokenizer = \"tok.json\"\n"
               "[sample]\nmax_tokens = 8\nprompt = \"The \"\n");
    r = run_memtrain("train " + dir + "/run.toml --set io.out_dir=" + dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("\nmodel  n_layer=2 "), std::string::npos) << "config printed";
    EXPECT_NE(r.output.find("step     6/6"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("val loss"), std::string::npos);
    EXPECT_NE(r.output.find("memory breakdown"), std::string::npos);
    EXPECT_NE(r.output.find("optimizer state"), std::string::npos);
    EXPECT_NE(r.output.find("sample"), std::string::npos);
    EXPECT_TRUE(fs::exists(dir + "/out/ckpt_000006/tokenizer.json"));
    r = run_memtrain("sample " + dir + "/out --prompt \"A journey\" --max-tokens 5 --top-k 5");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.output.rfind("A journey", 0), 0u) << r.output;
    // Resume with more steps continues from step 6.
    r = run_memtrain("train " + dir + "/run.toml --set io.out_dir=" + dir +
                     "/out --set train.max_steps=8 --resume " + dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("step     8/8"), std::string::npos) << r.output;
    // sample.temperature = 0 in a config is greedy, as --temperature 0 is on the command line.
    r = run_memtrain("train " + dir + "/run.toml --set io.out_dir=" + dir +
                     "/greedy train.max_steps=1 sample.temperature=0");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("\nsample (greedy):\n"), std::string::npos) << r.output;
}

// A model whose every next token is end-of-text: greedy sampling stops at once and says why on
// stderr, apart from the text. (Zero weights but the final norm's bias b, and b as the
// embedding row of <|endoftext|>: its logit b.b is the only non-zero one.)
TEST(Cli, SamplingThatStopsAtEndOfTextSaysSo) {
    auto dir = memtrain::test::temp_dir("cli_eot");
    auto r = memtrain::test::tokenize_corpus(dir, small_corpus(), 300);
    ASSERT_EQ(r.code, 0) << r.output;
    const auto tok = memtrain::data::Tokenizer::load(dir + "/tok.json");
    ASSERT_TRUE(tok.eot_token());
    memtrain::ModelConfig cfg = memtrain::test::tiny_model(1);
    cfg.vocab_size = tok.vocab_size();
    memtrain::GPT model(cfg);
    std::fill(model.params(), model.params() + model.num_params(), 0.0f);
    const memtrain::ParamSpec& bias = model.layout().get("ln_f.bias");
    const memtrain::ParamSpec& wte = model.layout().get("wte.weight");
    for (int c = 0; c < cfg.n_embd; c++) {
        model.params()[bias.offset + c] = 1.0f;
        model.params()[wte.offset + (std::size_t)*tok.eot_token() * cfg.n_embd + c] = 1.0f;
    }
    const std::string hf = dir + "/hf";
    fs::create_directories(hf);
    memtrain::save_hf_weights(model, hf + "/model.safetensors");
    write_file(hf + "/config.json", memtrain::hf_config_json(cfg));
    fs::copy_file(dir + "/tok.json", hf + "/tokenizer.json");
    r = memtrain::test::run_command("timeout -k 5 120 " + std::string(MT_BINARY_DIR) +
                                        "/memtrain sample " + hf +
                                        " --prompt Hello --temperature 0 --max-tokens 5",
                                    /*merge_stderr=*/false);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.output, "Hello\n") << "stdout holds the text alone";
    r = run_memtrain("sample " + hf + " --prompt Hello --temperature 0 --max-tokens 5");
    EXPECT_NE(r.output.find("memtrain: the model ended the text (end-of-text token) after 0 of "
                            "--max-tokens 5 tokens (greedy: every run of this prompt stops there)"),
              std::string::npos)
        << r.output;
}

TEST(Cli, BadInputGivesOneClearLineAndNonZeroExit) {
    auto dir = memtrain::test::temp_dir("cli_bad");
    auto r = run_memtrain("train " + dir + "/missing.toml");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;

    r = run_memtrain("train --set modle.n_layer=2");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("did you mean 'model.n_layer'"), std::string::npos) << r.output;

    // A misspelt command: the one meant, a usage error's exit code.
    r = run_memtrain("trian " + dir + "/missing.toml");
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.output.find("memtrain: error: unknown command 'trian'; did you mean \"train\"?"),
              std::string::npos)
        << r.output;

    write_file(dir + "/bad.toml", "[train]\nbatch_size = \"eight\"\n");
    r = run_memtrain("train " + dir + "/bad.toml");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("train.batch_size must be an integer"), std::string::npos) << r.output;

    write_file(dir + "/nodata.toml", "[data]\ntrain = \"nowhere.bin\"\n");
    r = run_memtrain("train " + dir + "/nodata.toml");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("nowhere.bin"), std::string::npos) << r.output;

    write_file(dir + "/notashard.bin", std::string(200, 'x'));
    r = run_memtrain("train --set data.train=" + dir + "/notashard.bin");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("magic"), std::string::npos) << r.output;

    r = run_memtrain("sample " + dir + "/nothing");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;

    r = run_memtrain("frobnicate");
    EXPECT_NE(r.code, 0);
}

TEST(Cli, TruncatedCheckpointIsNamedAndNothingIsOverwritten) {
    auto dir = memtrain::test::temp_dir("cli_trunc");
    memtrain::RunConfig c = memtrain::test::tiny_run(dir, 2);
    write_file(dir + "/run.toml", memtrain::to_toml(c));
    auto r = run_memtrain("train " + dir + "/run.toml");
    ASSERT_EQ(r.code, 0) << r.output;
    std::string model = dir + "/out/ckpt_000002/model.safetensors";
    fs::resize_file(model, fs::file_size(model) - 100);
    auto size_before = fs::file_size(model);
    r = run_memtrain("sample " + dir + "/out --tokenizer " + std::string(MT_SOURCE_DIR) +
                     "/third_party/gpt2 --max-tokens 2");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("model.safetensors"), std::string::npos) << r.output;
    EXPECT_EQ(fs::file_size(model), size_before);
}

TEST(Cli, RematScheduleFrontierAndTooSmallBudget) {
    auto dir = memtrain::test::temp_dir("cli_remat");
    std::string cfg = std::string(MT_SOURCE_DIR) + "/configs/demo.toml";
    auto r = run_memtrain("remat " + cfg + " --budget 100MiB");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("predicted peak activation memory"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("predicted recompute overhead"), std::string::npos) << r.output;
    r = run_memtrain("remat " + cfg + " --frontier --svg " + dir + "/frontier.svg");
    ASSERT_EQ(r.code, 0) << r.output;
    for (const char* row :
         {"none", "selective", "sqrt", "full", "budget:", "chen:3 ", "memory-poor ", "IDDDDD"})
        EXPECT_NE(r.output.find(row), std::string::npos) << row;
    std::ifstream svg(dir + "/frontier.svg");
    std::string head(5, '\0');
    svg.read(head.data(), 5);
    EXPECT_EQ(head, "<svg ");
    // The schedule animated: every event of the step, the live bytes within the arena.
    r = run_memtrain("remat " + cfg + " --set train.remat=memory-poor --animate " + dir +
                     "/poor.svg");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("poor.svg: 33 events, at most"), std::string::npos) << r.output;
    EXPECT_NE(memtrain::test::read_file(dir + "/poor.svg").find("rebuild 4"), std::string::npos);
    r = run_memtrain("remat " + cfg + " --frontier --animate " + dir + "/x.svg");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("--animate draws one schedule"), std::string::npos) << r.output;
    r = run_memtrain("remat " + cfg + " --budget 1KiB");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("smallest feasible peak activation memory"), std::string::npos)
        << r.output;
    r = run_memtrain("train " + cfg + " --set train.remat=budget:lots");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("train.remat"), std::string::npos) << r.output;
}

// remat --frontier --measure times the no-recompute step three times (before, between and after
// the others), prints their spread, and never shows a schedule faster than no recompute without
// a warning naming it (issue 26).
TEST(Cli, RematMeasureRepeatsItsBaselineAndWarnsOnNegativeCost) {
    const std::string cfg = std::string(MT_SOURCE_DIR) + "/configs/demo.toml";
    auto r = run_memtrain("remat " + cfg +
                          " --frontier --measure --set model.n_layer=2 --set train.seq_len=32");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("over the fastest of 3 timings of the no-recompute step"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("spread "), std::string::npos) << r.output;
    // Every row: name, peak MiB, peak bytes, recompute, measured, ...
    std::istringstream rows(r.output.substr(r.output.find("\nnone ") + 1));
    std::string line;
    int table_rows = 0;
    while (std::getline(rows, line) && !line.empty()) {
        std::istringstream f(line);
        std::string name, mib, bytes, recompute, measured;
        f >> name >> mib >> bytes >> recompute >> measured;
        table_rows++;
        if (name == "none") {
            EXPECT_EQ(measured, "+0.00%") << line;
        }
        if (!measured.empty() && measured[0] == '-') {
            EXPECT_NE(r.output.find("warning: "), std::string::npos) << r.output;
            const auto w = r.output.find("measured faster than no recompute (");
            ASSERT_NE(w, std::string::npos) << r.output;
            EXPECT_NE(r.output.find(name, w), std::string::npos) << name << "\n" << r.output;
        }
    }
    EXPECT_GE(table_rows, 15) << r.output;
}

// The GPU engine's layout is priced without a GPU: bf16 activations and no attention
// probabilities make every schedule smaller than the CPU's.
TEST(Cli, RematPricesTheGpuLayoutAnywhere) {
    std::string cfg = std::string(MT_SOURCE_DIR) + "/configs/demo.toml";
    auto peak = [](const std::string& out, const std::string& row) {
        auto at = out.find("\n" + row + " ");
        EXPECT_NE(at, std::string::npos) << row << "\n" << out;
        return at == std::string::npos ? 0.0 : std::stod(out.substr(at + row.size() + 2));
    };
    auto cpu = run_memtrain("remat " + cfg + " --frontier --device cpu --precision fp32");
    auto gpu = run_memtrain("remat " + cfg + " --frontier --device cuda --precision bf16");
    ASSERT_EQ(cpu.code, 0) << cpu.output;
    ASSERT_EQ(gpu.code, 0) << gpu.output;
    EXPECT_NE(gpu.output.find("activation layout: cuda, bf16"), std::string::npos) << gpu.output;
    for (const char* row : {"none", "selective", "full"})
        EXPECT_LT(peak(gpu.output, row), 0.6 * peak(cpu.output, row)) << row;
    auto bad = run_memtrain("remat " + cfg + " --device cuda --precision fp8");
    EXPECT_EQ(bad.code, 1);
    EXPECT_NE(bad.output.find("--precision fp8"), std::string::npos) << bad.output;
    bad = run_memtrain("remat " + cfg + " --device cuda --measure");
    EXPECT_EQ(bad.code, 1);
    EXPECT_NE(bad.output.find("--measure profiles the CPU kernels"), std::string::npos)
        << bad.output;
    // Recompute and offload together: the frontier's +offload rows go below `full`, and a budget
    // only offloading reaches is solved with offloaded inputs; the CPU layout refuses it.
    EXPECT_NE(gpu.output.find("+offload"), std::string::npos) << gpu.output;
    EXPECT_LT(peak(gpu.output, "offload"), peak(gpu.output, "full"));
    // The GPU model rebuilds dropped block inputs too: memory-poor is on its frontier, below full.
    EXPECT_LT(peak(gpu.output, "memory-poor"), peak(gpu.output, "full"));
    const std::string at =
        std::to_string((std::size_t)((peak(gpu.output, "offload") + 0.01) * 1048576));
    auto mixed = run_memtrain("remat " + cfg + " --device cuda --budget " + at + "+offload");
    ASSERT_EQ(mixed.code, 0) << mixed.output;
    EXPECT_NE(mixed.output.find(" offload "), std::string::npos) << mixed.output;
    bad = run_memtrain("remat " + cfg + " --device cpu --budget 40MiB+offload");
    EXPECT_EQ(bad.code, 1);
    EXPECT_NE(bad.output.find("price it with --device cuda"), std::string::npos) << bad.output;
}
