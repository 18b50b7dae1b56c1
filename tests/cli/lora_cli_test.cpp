// LoRA end to end through the binary: pre-train a tiny GPT, fine-tune it with LoRA and with
// QLoRA from model.init_from, resume, merge, and evaluate the merged model and the checkpoint
// (the same loss); bad input is one line, a non-zero exit, and no output directory.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace memtrain {
namespace {

using test::eval_loss;
using test::run_memtrain;
using test::write_file;

TEST(LoraCli, FineTuneResumeMergeAndEvaluate) {
    const std::string dir = test::temp_dir("lora_cli");
    auto r = test::tokenize_corpus(dir, test::small_corpus(), 320);
    ASSERT_EQ(r.code, 0) << r.output;
    write_file(dir + "/gpt.toml",
               "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nblock_size = 32\n"
               "vocab_size = 320\n"
               "[train]\nseq_len = 16\nbatch_size = 4\nmax_steps = 20\ndevice = \"cpu\"\n"
               "eval_every = 0\n"
               "[optim]\nlr = 3e-3\n"
               "[data]\ntrain = \"train.bin\"\nval = \"val.bin\"\ntokenizer = \"tok.json\"\n"
               "[sample]\nmax_tokens = 0\n");
    r = run_memtrain("train " + dir + "/gpt.toml --set io.out_dir=" + dir + "/base");
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string val = dir + "/val.bin";
    const double base = eval_loss(dir + "/base", val);

    for (const std::string frozen : {"fp32", "int8"}) {
        const std::string out = dir + "/lora_" + frozen;
        const std::string sets = " --set model.init_from=" + dir + "/base/ckpt_000020" +
                                 " lora.rank=4 lora.alpha=8 lora.targets=all lora.base=" + frozen +
                                 " optim.lr=1e-2 io.out_dir=" + out;
        r = run_memtrain("train " + dir + "/gpt.toml" + sets + " train.max_steps=6");
        ASSERT_EQ(r.code, 0) << r.output;
        EXPECT_NE(r.output.find("LoRA r=4"), std::string::npos) << r.output;
        EXPECT_NE(r.output.find("4 x adapters"), std::string::npos) << r.output;
        if (frozen != "fp32") {
            EXPECT_NE(r.output.find("QLoRA base: quantized base int8"), std::string::npos)
                << r.output;
        }
        r = run_memtrain("train " + dir + "/gpt.toml" + sets + " train.max_steps=10 --resume " +
                         out);
        ASSERT_EQ(r.code, 0) << r.output;
        EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
        EXPECT_TRUE(fs::exists(out + "/ckpt_000010/adapter_model.safetensors"));

        const double tuned = eval_loss(out, val);
        EXPECT_LT(tuned, base) << frozen << ": fine-tuning did not lower the held-out loss";
        r = run_memtrain("lora merge " + out + " --out " + out + "/merged");
        ASSERT_EQ(r.code, 0) << r.output;
        EXPECT_TRUE(fs::exists(out + "/merged/model.safetensors"));
        EXPECT_TRUE(fs::exists(out + "/merged/config.json"));
        EXPECT_NEAR(eval_loss(out + "/merged", val), tuned, 1e-5) << frozen;
        r = run_memtrain("sample " + out + "/merged --prompt The --max-tokens 4");
        EXPECT_EQ(r.code, 0) << r.output;
    }

    // Bad input: a checkpoint without adapters, an --out that is not a merge output.
    r = run_memtrain("lora merge " + dir + "/base --out " + dir + "/m1");
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.output.find("holds no LoRA adapters"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir + "/m1"));
    r = run_memtrain("lora merge " + dir + "/lora_fp32 --out " + dir + "/base");
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.output.find("refusing to replace"), std::string::npos) << r.output;
    r = run_memtrain("train " + dir + "/gpt.toml --set lora.rank=4 lora.targets=q_proj");
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.output.find("matches no module"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace memtrain
