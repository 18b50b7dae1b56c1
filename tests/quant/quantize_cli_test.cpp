// `memtrain quantize` end to end through the binary: a tiny trained GPT quantized with every
// method is a model directory that `memtrain eval` reads, its bit counts match the bytes of
// quantized.safetensors, and bad input leaves no output directory behind.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace memtrain {
namespace {

using test::eval_loss;
using test::run_memtrain;
using test::write_file;

TEST(QuantCli, EveryMethodGivesAModelThatEvalReads) {
    const std::string dir = test::temp_dir("quant_cli");
    auto r = memtrain::test::tokenize_corpus(dir, test::small_corpus(), 320);
    ASSERT_EQ(r.code, 0) << r.output;
    write_file(dir + "/gpt.toml",
               "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nblock_size = 32\n"
               "vocab_size = 320\n"
               "[train]\nseq_len = 32\nbatch_size = 4\nmax_steps = 30\ndevice = \"cpu\"\n"
               "eval_every = 0\n"
               "[optim]\nlr = 3e-3\n"
               "[data]\ntrain = \"train.bin\"\nval = \"val.bin\"\ntokenizer = \"tok.json\"\n"
               "[sample]\nmax_tokens = 0\n");
    r = run_memtrain("train " + dir + "/gpt.toml --set io.out_dir=" + dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string ckpt = dir + "/out", val = dir + "/val.bin";
    const double fp32 = eval_loss(ckpt, val);

    struct Case {
        std::string args;
        double bpw_lo, bpw_hi;
    };
    const Case cases[] = {
        {"--method rtn --bits 8", 8.0, 8.3},
        {"--method rtn --bits 4", 4.0, 4.3},
        {"--method rtn-asym --bits 4", 4.0, 4.4},
        {"--method rtn --bits 4 --group 32", 4.5, 4.5},
        {"--method nf4", 4.5, 4.5},
        {"--method nf4-dq", 4.12, 4.2},
        {"--method uniform --bits 4", 4.0, 4.01},
        {"--method kmeans --bits 4", 4.0, 4.1},
        {"--method kashin --bits 4 --seed 1", 4.0, 4.3},
        {"--method kashin-dct --bits 4 --seed 1", 4.2, 5.1},  // 4 + 64/in, in = 64 or 256
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.args);
        const std::string out = dir + "/q";
        r = run_memtrain("quantize " + ckpt + " " + c.args + " --out " + out);
        ASSERT_EQ(r.code, 0) << r.output;
        EXPECT_NE(r.output.find("bpw over quantized tensors"), std::string::npos) << r.output;
        std::ifstream jf(out + "/quantization.json");
        const auto j = nlohmann::json::parse(jf);
        EXPECT_EQ(j["tensors"].size(), 8u);  // 2 layers x (c_attn, attn.c_proj, c_fc, mlp.c_proj)
        const double bpw = j["totals"]["bpw_quantized"].get<double>();
        EXPECT_GE(bpw, c.bpw_lo - 1e-9);
        EXPECT_LE(bpw, c.bpw_hi + 1e-9);
        // The bits counted are the bytes stored.
        const auto q = io::SafetensorsFile::open(out + "/quantized.safetensors");
        uint64_t bytes = 0;
        for (const auto& t : q.tensors()) bytes += t.end - t.begin;
        EXPECT_EQ(8 * bytes, j["totals"]["quantized_stored_bits"].get<uint64_t>());
        if (c.args.find("--method kashin ") != std::string::npos) {
            EXPECT_TRUE(j["totals"].contains("fallbacks"));
            EXPECT_TRUE(j["tensors"][0].contains("iterations"));
        }
        const double loss = eval_loss(out, val);
        EXPECT_LT(loss, fp32 + 1.0);
        if (c.args == "--method rtn --bits 8") {
            EXPECT_NEAR(loss, fp32, 0.01 * fp32);
        }
    }
    // A non-converging Kashin run names its fallbacks.
    r = run_memtrain("quantize " + ckpt + " --method kashin --bits 4 --max-iter 2 --out " + dir +
                     "/q");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("8 of 8 fell back to rtn"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("fallback"), std::string::npos) << r.output;
}

TEST(QuantCli, BadInputIsOneLineAndNoOutput) {
    const std::string dir = test::temp_dir("quant_cli_bad");
    const std::string out = dir + "/q";
    auto r = run_memtrain("quantize " + dir + "/missing --method rtn --bits 4 --out " + out);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;
    // A real model: the tiny run above may not exist when this test runs alone, so make one.
    r = memtrain::test::tokenize_corpus(dir, test::small_corpus(), 300);
    ASSERT_EQ(r.code, 0) << r.output;
    write_file(dir + "/gpt.toml",
               "[model]\nn_layer = 1\nn_head = 2\nn_embd = 64\nblock_size = 16\nvocab_size = 300\n"
               "[train]\nseq_len = 16\nbatch_size = 2\nmax_steps = 1\neval_every = 0\n"
               "[data]\ntrain = \"train.bin\"\nval = \"val.bin\"\ntokenizer = \"tok.json\"\n"
               "[sample]\nmax_tokens = 0\n");
    r = run_memtrain("train " + dir + "/gpt.toml --set io.out_dir=" + dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    for (const std::string args :
         {"--method gptq --bits 4", "--method nf4 --bits 3", "--method rtn --bits 4 --group 48",
          "--method kmeans --bits 9", "--method uniform --bits 4 --group 32"}) {
        r = run_memtrain("quantize " + dir + "/out " + args + " --out " + out);
        EXPECT_EQ(r.code, 1) << args << ": " << r.output;
        EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
        EXPECT_FALSE(fs::exists(out)) << args;
        for (const auto& e : fs::directory_iterator(fs::path(out).parent_path()))  // OUT.tmp.XXXXXX
            EXPECT_NE(
                e.path().filename().string().rfind(fs::path(out).filename().string() + ".tmp", 0),
                0u)
                << args << ": " << e.path();
    }
}

}  // namespace
}  // namespace memtrain
