// Model loading: presets, nearest-name suggestions, HF config.json and memtrain TOML.
#include <gtest/gtest.h>

#include "core/error.h"
#include "plan/model_spec.h"

using namespace memtrain::plan;

TEST(PlanModel, UnknownPresetSuggestsNearest) {
    try {
        load_model("llama2-7");
        FAIL();
    } catch (const memtrain::Error& e) {
        EXPECT_NE(std::string(e.what()).find("did you mean \"llama2-7b\""), std::string::npos)
            << e.what();
    }
}

TEST(PlanModel, Gpt2HfConfig) {
    ModelSpec m = model_from_hf_json(
        R"({"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024, "vocab_size": 50257})",
        "config.json");
    EXPECT_EQ(m.total_params(), 124'439'808);  // GPT-2 small, tied embeddings
}

TEST(PlanModel, LlamaHfConfig) {
    ModelSpec m = model_from_hf_json(
        R"({"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 8192})",
        "config.json");
    EXPECT_EQ(m.total_params(), 8'030'261'248);  // Llama-3-8B
    EXPECT_EQ(m.total_params(), load_model("llama3-8b").total_params());
}

TEST(PlanModel, HfConfigErrors) {
    EXPECT_THROW(model_from_hf_json("{", "x.json"), memtrain::Error);
    EXPECT_THROW(model_from_hf_json(R"({"foo": 1})", "x.json"), memtrain::Error);
    EXPECT_THROW(model_from_hf_json(R"({"n_layer": 2, "n_head": 3, "n_embd": 8, "vocab_size": 5})",
                                    "x.json"),
                 memtrain::Error);  // 8 not divisible by 3
}

TEST(PlanModel, MemtrainToml) {
    ModelSpec m = model_from_toml(R"([model]
n_layer = 2
n_head = 4
n_embd = 64
block_size = 32
vocab_size = 100
norm = "rmsnorm"
activation = "swiglu"
positions = "rope"
tied_embeddings = false
ffn_hidden = 128
)",
                                  "tiny.toml");
    // per layer: attn 4*64^2 + mlp 3*64*128 + 2 rmsnorm 64 = 16384 + 24576 + 128
    EXPECT_EQ(m.layer_params(), 41'088);
    EXPECT_EQ(m.total_params(), 2 * 41'088 + 2 * 100 * 64 + 64);
    EXPECT_THROW(model_from_toml("[model]\nnorm = \"rms\"\n", "bad.toml"), memtrain::Error);
    EXPECT_THROW(model_from_toml("[train]\n", "bad.toml"), memtrain::Error);
}

TEST(PlanModel, RepoConfigMatchesEngineLayout) {
    // configs/gpt2-1.5b.toml pads the vocabulary to 50304 rows, as the engine allocates.
    ModelSpec m = load_model(std::string(MT_SOURCE_DIR) + "/configs/gpt2-1.5b.toml");
    EXPECT_EQ(m.vocab_size, 50304);
    EXPECT_EQ(m.total_params(), 1'557'611'200 + 47LL * 1600);
}
