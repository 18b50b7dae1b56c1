// Model loading: presets, nearest-name suggestions, HF config.json and memtrain TOML.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "core/error.h"
#include "io/checkpoint.h"
#include "model/param_layout.h"
#include "planner/hardware.h"
#include "planner/model_shape.h"
#include "test_util.h"

namespace memtrain::plan {

TEST(PlanModel, UnknownPresetSuggestsNearest) {
    try {
        load_model("llama2-7");
        FAIL();
    } catch (const memtrain::Error& e) {
        EXPECT_NE(std::string(e.what()).find("did you mean \"llama2-7b\""), std::string::npos)
            << e.what();
    }
}

// Other tools' names for the same presets, and a GPU family without its memory size.
TEST(PlanModel, OtherToolsNamesAndGpuFamiliesSuggestThePreset) {
    std::string m = test::error_of([] { load_model("gpt2-1.5b"); });
    EXPECT_NE(m.find("unknown model \"gpt2-1.5b\"; did you mean \"gpt2-xl\"?"), std::string::npos)
        << m;
    m = test::error_of([] { load_model("Llama-3.1-8B"); });
    EXPECT_NE(m.find("did you mean \"llama3-8b\"?"), std::string::npos) << m;
    m = test::error_of([] { gpu_preset("a100"); });
    EXPECT_NE(m.find("unknown GPU \"a100\"; did you mean \"a100-40gb\" or \"a100-80gb\"?"),
              std::string::npos)
        << m;
    m = test::error_of([] { gpu_preset("h100"); });
    EXPECT_NE(m.find("did you mean \"h100-80gb\"?"), std::string::npos) << m;
    m = test::error_of([] { gpu_preset("a10O-80gb"); });  // a typo: the nearest
    EXPECT_NE(m.find("did you mean \"a100-80gb\"?"), std::string::npos) << m;
    m = test::error_of([] { gpu_preset("v100"); });
    EXPECT_NE(m.find("did you mean \"v100-16gb\" or \"v100-32gb\"?"), std::string::npos) << m;
    for (const char* name : {"4090", "RTX4090", "mi300"}) {
        m = test::error_of([&] { gpu_preset(name); });
        EXPECT_NE(m.find(std::string(name) == "mi300" ? "\"mi300x\"" : "\"rtx-4090\""),
                  std::string::npos)
            << m;
    }
}

// Every preset is whole: the numbers the estimate divides by are positive, the host of its
// typical node is named, and only Volta lacks bf16.
TEST(PlanModel, GpuPresetsAreWhole) {
    for (const std::string& name : gpu_preset_names()) {
        const GpuSpec g = gpu_preset(name);
        EXPECT_GT(g.memory_bytes, 0) << name;
        EXPECT_GT(g.peak_flops, g.peak_flops_fp32 * 0.99) << name;
        EXPECT_GT(g.hbm_bandwidth, 0) << name;
        EXPECT_GT(g.intra_node_bw, 0) << name;
        EXPECT_GT(g.inter_node_bw, 0) << name;
        EXPECT_GT(g.pcie_bw, 0) << name;
        EXPECT_GT(g.host_memory_per_gpu, 0) << name;
        EXPECT_FALSE(g.host_memory_source.empty()) << name;
        EXPECT_EQ(g.bf16, name.rfind("v100", 0) != 0) << name;
    }
    EXPECT_EQ(gpu_preset_names().size(), 11u);
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
    // per layer: attn 4*64^2 + mlp 3*64*128 + 2 rmsnorm 64 = 16384 + 24576 + 128, and the
    // engine's linear biases: qkv 192 + proj 64 + fc 256 + fc_proj 64
    EXPECT_EQ(m.layer_params(), 41'088 + 576);
    // The engine pads the vocabulary to 64 rows (model.vocab_pad's default): 128 x 64 tables.
    EXPECT_EQ(m.total_params(), 2 * (41'088 + 576) + 2 * 128 * 64 + 64);
    memtrain::ModelConfig c;
    c.n_layer = 2, c.n_head = 4, c.n_embd = 64, c.block_size = 32, c.vocab_size = 100;
    c.norm = "rmsnorm", c.activation = "swiglu", c.positions = "rope";
    c.tied_embeddings = false, c.ffn_hidden = 128;
    EXPECT_EQ(m.total_params(), static_cast<int64_t>(memtrain::make_param_layout(c).total));
    EXPECT_THROW(model_from_toml("[model]\nnorm = \"rms\"\n", "bad.toml"), memtrain::Error);
    EXPECT_THROW(model_from_toml("[train]\n", "bad.toml"), memtrain::Error);
}

TEST(PlanModel, RepoConfigMatchesEngineLayout) {
    // configs/gpt2-1.5b.toml pads the vocabulary to 50304 rows, as the engine allocates.
    ModelSpec m = load_model(std::string(MT_SOURCE_DIR) + "/configs/gpt2-1.5b.toml");
    EXPECT_EQ(m.vocab_size, 50304);
    EXPECT_EQ(m.total_params(), 1'557'611'200 + 47LL * 1600);
}

namespace {

// Tensor elements of a memtrain checkpoint's model.safetensors: the engine's layout with the
// real vocabulary rows (io/checkpoint.cpp writes wte and lm_head without the padding).
int64_t checkpoint_numel(const memtrain::ModelConfig& c) {
    int64_t n = 0;
    for (const auto& t : memtrain::make_param_layout(c).tensors) {
        const bool vocab_rows = t.name == "wte.weight" || t.name == "lm_head.weight";
        n += vocab_rows ? static_cast<int64_t>(c.vocab_size) * c.n_embd
                        : static_cast<int64_t>(t.numel);
    }
    return n;
}

// Tensor elements of Hugging Face's LlamaForCausalLM, from its module shapes.
int64_t hf_llama_numel(int64_t layers, int64_t h, int64_t heads, int64_t kv_heads, int64_t ffn,
                       int64_t vocab, bool tied, bool attn_bias, bool mlp_bias) {
    const int64_t kv = kv_heads * (h / heads);
    int64_t layer = h * h + 2 * kv * h + h * h;  // q_proj, k_proj, v_proj, o_proj
    if (attn_bias) layer += h + 2 * kv + h;
    layer += 3 * ffn * h;  // gate_proj, up_proj, down_proj
    if (mlp_bias) layer += 2 * ffn + h;
    layer += 2 * h;  // input_layernorm, post_attention_layernorm
    return vocab * h + layers * layer + h + (tied ? 0 : vocab * h);
}

std::string refusal(const std::string& json) {
    try {
        model_from_hf_json(json, "config.json");
    } catch (const memtrain::Error& e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST(PlanModel, MemtrainCheckpointConfigsCountTheirTensors) {
    memtrain::ModelConfig gpt2 = memtrain::test::tiny_model();
    memtrain::ModelConfig llama_style = gpt2;
    llama_style.n_head = 4, llama_style.n_kv_head = 1, llama_style.n_embd = 32;
    llama_style.norm = "rmsnorm", llama_style.activation = "swiglu", llama_style.positions = "rope";
    llama_style.tied_embeddings = false;
    memtrain::ModelConfig untied_gelu = gpt2;  // not GPT-2, so memtrain-llama-style too
    untied_gelu.tied_embeddings = false, untied_gelu.ffn_hidden = 48;
    for (const auto& c : {gpt2, llama_style, untied_gelu}) {
        const std::string json = memtrain::hf_config_json(c);
        const ModelSpec m = model_from_hf_json(json, "ckpt/config.json");
        EXPECT_EQ(m.total_params(), checkpoint_numel(c)) << json;
        EXPECT_EQ(m.kv_heads(), c.kv_heads()) << json;
        EXPECT_EQ(m.ffn(), c.mlp_hidden()) << json;
    }
    EXPECT_NE(memtrain::hf_config_json(gpt2).find("\"gpt2\""), std::string::npos);
    EXPECT_NE(memtrain::hf_config_json(llama_style).find("memtrain-llama-style"),
              std::string::npos);
}

TEST(PlanModel, HfLlamaConfigCountsItsTensors) {
    // GQA, untied head, no biases: what memtrain writes for a Llama-style checkpoint.
    ModelSpec m = model_from_hf_json(R"({"model_type": "llama", "architectures":
        ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 176,
        "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 3,
        "vocab_size": 300, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": false, "attention_bias": false,
        "mlp_bias": false})",
                                     "config.json");
    EXPECT_EQ(m.total_params(), hf_llama_numel(3, 64, 8, 2, 176, 300, false, false, false));
    // Tied, with biases on attention and MLP.
    m = model_from_hf_json(R"({"model_type": "llama", "hidden_size": 64,
        "intermediate_size": 176, "num_attention_heads": 8, "num_hidden_layers": 2,
        "vocab_size": 300, "tie_word_embeddings": true, "attention_bias": true,
        "mlp_bias": true})",
                           "config.json");
    EXPECT_EQ(m.total_params(), hf_llama_numel(2, 64, 8, 8, 176, 300, true, true, true));
    m = model_from_hf_json(R"({"model_type": "llama", "hidden_size": 64,
        "intermediate_size": 176, "num_attention_heads": 8, "num_hidden_layers": 2,
        "vocab_size": 300, "attention_bias": true})",
                           "config.json");
    EXPECT_EQ(m.total_params(), hf_llama_numel(2, 64, 8, 8, 176, 300, false, true, false));
}

TEST(PlanModel, HfGpt2ConfigReadsDropoutAndTying) {
    const std::string base =
        R"("model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 16, "n_positions": 8,
           "vocab_size": 37)";
    ModelSpec hf = model_from_hf_json("{" + base + "}", "config.json");
    EXPECT_TRUE(hf.dropout);  // Hugging Face's default pdrop is 0.1
    ModelSpec none = model_from_hf_json(
        "{" + base + R"(, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})",
        "config.json");
    EXPECT_FALSE(none.dropout);
    ModelSpec untied =
        model_from_hf_json("{" + base + R"(, "tie_word_embeddings": false})", "config.json");
    EXPECT_EQ(untied.total_params() - hf.total_params(), 37 * 16);
}

TEST(PlanModel, MixtureOfExpertsIsRefused) {
    const char* configs[] = {
        R"({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_hidden_layers": 32, "vocab_size": 32000,
            "num_local_experts": 8, "num_experts_per_tok": 2})",
        R"({"model_type": "qwen2_moe", "hidden_size": 2048, "num_experts": 60})",
        R"({"model_type": "deepseek_v3", "n_routed_experts": 256})",
        R"({"model_type": "dbrx", "d_model": 6144})",
        // A dense model_type with expert keys is still an MoE.
        R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
            "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 300,
            "num_local_experts": 4})",
        R"({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 176,
            "num_attention_heads": 8, "vocab_size": 300, "moe_intermediate_size": 32})",
    };
    for (const char* c : configs) {
        const std::string msg = refusal(c);
        EXPECT_NE(msg.find("mixture-of-experts"), std::string::npos) << c << "\n" << msg;
        EXPECT_NE(msg.find("gpt2, llama"), std::string::npos) << msg;
    }
    EXPECT_NE(refusal(configs[0]).find("model_type \"mixtral\""), std::string::npos);
    EXPECT_NE(refusal(configs[2]).find("n_routed_experts"), std::string::npos);
    // Expert counts of zero are a dense model.
    EXPECT_EQ(refusal(R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
        "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 300,
        "num_experts": 0})"),
              "");
}

TEST(PlanModel, UnknownModelTypeIsRefused) {
    for (const char* type : {"bert", "qwen2", "t5", "falcon"}) {
        // Llama-like keys must not make an unknown architecture read as Llama.
        const std::string msg = refusal(fmt::format(
            R"({{"model_type": "{}", "hidden_size": 64, "intermediate_size": 176,
                "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 300}})",
            type));
        EXPECT_NE(msg.find(fmt::format("model_type \"{}\" is not supported", type)),
                  std::string::npos)
            << msg;
        EXPECT_NE(msg.find("gpt2, llama, mistral, memtrain-llama-style"), std::string::npos) << msg;
    }
    EXPECT_NE(refusal(R"({"model_type": 3})").find("model_type"), std::string::npos);
    // Llama configs with heads of another width than hidden / heads are not modelled.
    EXPECT_NE(refusal(R"({"model_type": "mistral", "hidden_size": 5120,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "num_hidden_layers": 40, "vocab_size": 131072})")
                  .find("head_dim 128"),
              std::string::npos);
    // memtrain-llama-style names its choices; a wrong one is named.
    EXPECT_NE(refusal(R"({"model_type": "memtrain-llama-style", "n_layer": 2, "n_head": 2,
        "n_embd": 16, "n_positions": 8, "vocab_size": 37, "norm": "batchnorm",
        "activation": "gelu", "positions": "rope"})")
                  .find("\"norm\" = \"batchnorm\""),
              std::string::npos);
}

}  // namespace memtrain::plan
