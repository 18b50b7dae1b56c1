// A Llama trained by memtrain end to end through the binary: its checkpoint is a Hugging Face
// LlamaForCausalLM directory, which `sample` (greedy, KV cache), `eval` and `model.init_from`
// read, with or without memtrain's own files beside it.
#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace memtrain {
namespace {

using test::run_memtrain;
using test::write_file;

TEST(LlamaCli, TrainSampleEvalAndFineTuneFromTheHfDirectory) {
    const std::string dir = test::temp_dir("llama_cli");
    auto r = memtrain::test::tokenize_corpus(dir, test::small_corpus(), 320);
    ASSERT_EQ(r.code, 0) << r.output;
    write_file(dir + "/llama.toml",
               "[model]\nn_layer = 2\nn_head = 4\nn_kv_head = 2\nn_embd = 32\nblock_size = 32\n"
               "vocab_size = 320\nnorm = \"rmsnorm\"\nactivation = \"swiglu\"\n"
               "positions = \"rope\"\ntied_embeddings = false\nbias = false\n"
               "[train]\nseq_len = 32\nbatch_size = 4\nmax_steps = 6\ndevice = \"cpu\"\n"
               "eval_every = 0\n"
               "[data]\ntrain = \"train.bin\"\nval = \"val.bin\"\ntokenizer = \"tok.json\"\n"
               "[sample]\nmax_tokens = 0\n");
    r = run_memtrain("train " + dir + "/llama.toml --set io.out_dir=" + dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string ckpt = dir + "/out/ckpt_000006";
    auto st = io::SafetensorsFile::open(ckpt + "/model.safetensors");
    EXPECT_NE(st.find("model.layers.1.mlp.gate_proj.weight"), nullptr);
    EXPECT_EQ(st.find("h.0.attn.c_attn.bias"), nullptr) << "model.bias = false has no biases";
    std::ifstream cj(ckpt + "/config.json");
    auto config = nlohmann::json::parse(cj);
    EXPECT_EQ(config["model_type"], "llama");
    EXPECT_EQ(config["num_key_value_heads"], 2);
    // The ids `generate` stops at: the trained tokenizer's <|endoftext|> (its last id), also the
    // bos as in GPT-2's config (the tokenizer puts no token first).
    EXPECT_EQ(config["eos_token_id"], 319) << config.dump();
    EXPECT_EQ(config["bos_token_id"], 319) << config.dump();

    // Greedy decoding is deterministic whatever the seed.
    r = run_memtrain("sample " + dir + "/out --temperature 0 --max-tokens 8 --prompt \"The \"");
    ASSERT_EQ(r.code, 0) << r.output;
    auto r2 = run_memtrain("sample " + ckpt +
                           " --temperature 0 --max-tokens 8 --seed 99 --prompt \"The \"");
    EXPECT_EQ(r.output, r2.output);
    EXPECT_EQ(r.output.rfind("The ", 0), 0u) << r.output;

    // The same files without memtrain's: a Hugging Face model directory.
    const std::string hf = dir + "/hf";
    fs::create_directories(hf);
    for (const char* f : {"model.safetensors", "config.json", "tokenizer.json"})
        fs::copy_file(ckpt + "/" + f, hf + "/" + f);
    auto r3 = run_memtrain("sample " + hf + " --temperature 0 --max-tokens 8 --prompt \"The \"");
    EXPECT_EQ(r3.output, r.output);
    auto e1 = run_memtrain("eval " + ckpt + " --data " + dir + "/val.bin --seq-len 16 --json");
    ASSERT_EQ(e1.code, 0) << e1.output;
    auto e2 = run_memtrain("eval " + hf + " --data " + dir + "/val.bin --seq-len 16 --json");
    ASSERT_EQ(e2.code, 0) << e2.output;
    auto j1 = nlohmann::json::parse(e1.output), j2 = nlohmann::json::parse(e2.output);
    EXPECT_EQ(j1["loss"], j2["loss"]);
    EXPECT_GT(j1["tokens"].get<int>(), 0);
    EXPECT_NEAR(j1["perplexity"].get<double>(), std::exp(j1["loss"].get<double>()), 1e-2);
    r = run_memtrain("eval " + hf + " --data " + dir + "/val.bin");
    EXPECT_NE(r.output.find("perplexity"), std::string::npos) << r.output;
    // Progress: a line after the first batch (pace and ETA at once), on stderr.
    r = run_memtrain("eval " + hf + " --data " + dir + "/val.bin --seq-len 16 --batch 1");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("eval: batch 1/"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(", eta "), std::string::npos) << r.output;
    // A shard of fewer windows than --batch: one partial batch of all of them.
    auto e3 = run_memtrain("eval " + hf + " --data " + dir +
                           "/val.bin --seq-len 16 --batch 100000 --json");
    ASSERT_EQ(e3.code, 0) << e3.output;
    auto j3 = nlohmann::json::parse(e3.output);
    EXPECT_GE(j3["tokens"].get<int>(), j1["tokens"].get<int>());
    EXPECT_EQ(j3["tokens"].get<int>() % 16, 0);
    EXPECT_TRUE(std::isfinite(j3["loss"].get<double>()));

    // Fine-tuning starts from the Hugging Face directory.
    r = run_memtrain("train " + dir + "/llama.toml --set io.out_dir=" + dir +
                     "/ft --set train.max_steps=2 --set model.init_from=" + hf);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("initialised weights from"), std::string::npos) << r.output;

    // Bad input: one line naming what is wrong, non-zero exit.
    r = run_memtrain("eval " + dir + " --data " + dir + "/val.bin");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("not a model directory"), std::string::npos) << r.output;
    r = run_memtrain("sample " + hf + " --temperature -1");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("--temperature"), std::string::npos) << r.output;
    r = run_memtrain("eval " + hf + " --data " + dir + "/val.bin --seq-len 33");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("--seq-len"), std::string::npos) << r.output;
}

// model.init_from takes what docs/huggingface.md says it does: an out_dir with `latest`, and
// without [model] the source's own architecture; a source with tensors the model does not use
// (a 3-block checkpoint into a 2-block model) is refused unless model.init_partial says so.
TEST(LlamaCli, InitFromAnOutDirTakesItsArchitectureAndRefusesAPartialLoad) {
    const std::string dir = test::temp_dir("init_from_cli");
    auto r = memtrain::test::tokenize_corpus(dir, test::small_corpus(), 320);
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string run_keys =
        "[train]\nseq_len = 16\nbatch_size = 2\nmax_steps = 2\ndevice = \"cpu\"\n"
        "eval_every = 0\n[data]\ntrain = \"train.bin\"\ntokenizer = \"tok.json\"\n"
        "[sample]\nmax_tokens = 0\n";
    write_file(dir + "/deep.toml",
               "[model]\nn_layer = 3\nn_head = 2\nn_embd = 32\nblock_size = 16\n"
               "vocab_size = 320\nnorm = \"rmsnorm\"\nactivation = \"swiglu\"\n"
               "positions = \"rope\"\nbias = false\n" +
                   run_keys);
    r = run_memtrain("train " + dir + "/deep.toml --set io.out_dir=" + dir + "/deep");
    ASSERT_EQ(r.code, 0) << r.output;

    // No [model]: the out_dir (its `latest`) gives both the architecture and the weights
    // (model.dropout beside init_from is a training choice, not a [model] description).
    write_file(dir + "/ft.toml", run_keys);
    r = run_memtrain("train " + dir + "/ft.toml --set io.out_dir=" + dir +
                     "/ft model.dropout=0.1 model.init_from=" + dir + "/deep");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("dropout=0.1"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("initialised weights from " + dir + "/deep"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("n_layer=3 "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("norm=rmsnorm"), std::string::npos) << r.output;

    // A model of 2 blocks from the 3-block source: refused, naming the tensors and the blocks.
    const std::string shallow =
        " --set model.n_layer=2 model.n_head=2 model.n_embd=32 "
        "model.block_size=16 model.vocab_size=320 model.norm=rmsnorm "
        "model.activation=swiglu model.positions=rope model.bias=false ";
    r = run_memtrain("train " + dir + "/ft.toml" + shallow + "io.out_dir=" + dir +
                     "/shallow model.init_from=" + dir + "/deep");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("model.init_from = " + dir +
                            "/deep/ckpt_000002/model.safetensors "
                            "holds 9 tensors this model does not use "
                            "(model.layers.2.input_layernorm.weight, "),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("it has 3 blocks, model.n_layer = 2"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("model.init_partial = true"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir + "/shallow/latest"));
    // ... loaded on purpose: the first two blocks, and the run trains.
    r = run_memtrain("train " + dir + "/ft.toml" + shallow + "io.out_dir=" + dir +
                     "/shallow model.init_partial=true model.init_from=" + dir + "/deep");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_TRUE(fs::exists(dir + "/shallow/ckpt_000002/model.safetensors"));
    // A single file with no [model] cannot say what model it holds.
    r = run_memtrain("train " + dir + "/ft.toml --set io.out_dir=" + dir +
                     "/file model.init_from=" + dir + "/deep/ckpt_000002/model.safetensors");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("is not a model directory, and the config gives no [model]"),
              std::string::npos)
        << r.output;
}

}  // namespace
}  // namespace memtrain
