// Hugging Face Llama in and out, against tests/parity/hf_llama_reference.py: a float64 forward
// of transformers' LlamaForCausalLM that reads the HF files itself. The script writes a tiny
// sharded Llama (F32 + BF16 shards, GQA, untied head); memtrain loads it and must match the
// reference's loss, logits and greedy decode (through the KV cache); memtrain's own export is
// read back by the reference (so the export follows HF semantics, not only our importer) and
// by memtrain (bitwise).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/hf_weights.h"
#include "io/model_source.h"
#include "model/kv_decoder.h"
#include "test_util.h"
#include "train/sample.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace memtrain {
namespace {

const std::string kScript = std::string(MT_SOURCE_DIR) + "/tests/parity/hf_llama_reference.py";

void python(const std::string& args, const std::string& log) {
    const std::string cmd = "/usr/bin/python3 " + kScript + " " + args + " > " + log + " 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0)
        << cmd << " failed (python3-torch and python3-numpy for /usr/bin/python3 are needed; "
        << "scripts/deps.sh installs them); see " << log;
}

json hf_reference(const std::string& model_dir, const std::string& out) {
    python("ref " + model_dir + " " + out, out + ".log");
    std::ifstream f(out);
    return json::parse(f);
}

std::vector<int32_t> ints(const json& rows) {
    std::vector<int32_t> v;
    for (const auto& r : rows)
        for (const auto& x : r) v.push_back(x.get<int32_t>());
    return v;
}

// Checks memtrain's model against a reference file: loss, logits of row 0, greedy decode.
void expect_matches(GPT& m, const json& ref) {
    const auto x = ints(ref["inputs"]), y = ints(ref["targets"]);
    const int B = (int)ref["inputs"].size(), T = (int)ref["inputs"][0].size();
    const double loss = m.forward_loss(x.data(), y.data(), B, T);
    EXPECT_NEAR(loss, ref["loss"].get<double>(), 1e-5 * ref["loss"].get<double>());
    const int V = m.config().vocab_size;
    std::vector<float> logits((std::size_t)T * V);
    m.forward_logits(x.data(), 1, T, logits.data());
    const auto& want = ref["logits_row0"];
    ASSERT_EQ(want.size(), logits.size());
    double worst = 0;
    for (std::size_t i = 0; i < logits.size(); i++)
        worst = std::max(worst, std::abs(logits[i] - want[i].get<double>()));
    EXPECT_LT(worst, 1e-4) << "largest logit difference";
    ASSERT_GT(ref["min_margin"].get<double>(), 1e-3)
        << "the reference's greedy path has a near tie";
    std::vector<int32_t> prompt = ref["prompt"].get<std::vector<int32_t>>();
    SampleOptions greedy{(int)ref["greedy"].size(), 0.0, 0, -1};
    Rng rng(1);
    EXPECT_EQ(generate(m, prompt, greedy, rng), ref["greedy"].get<std::vector<int32_t>>());
}

TEST(HfLlama, ShardedHfModelMatchesTheFloat64Reference) {
    const std::string dir = test::temp_dir("hf_llama_in");
    python("make " + dir + "/model", dir + "/make.log");
    const json ref = hf_reference(dir + "/model", dir + "/ref.json");

    const ModelSource src = open_model_source(dir + "/model");
    const ModelConfig& c = src.model;
    EXPECT_TRUE(c.is_llama());
    EXPECT_EQ(c.n_embd, 64);
    EXPECT_EQ(c.kv_heads(), 2);
    EXPECT_EQ(c.mlp_hidden(), 96);
    EXPECT_FALSE(c.tied_embeddings);
    EXPECT_EQ(c.block_size, 64);
    GPT m(c);
    load_hf_weights(m.weights(), src.weights);
    expect_matches(m, ref);

    // memtrain's export, read by the reference and by memtrain.
    const std::string out = dir + "/export";
    fs::create_directories(out);
    save_hf_weights(m.weights(), out + "/model.safetensors");
    { std::ofstream(out + "/config.json") << hf_config_json(c); }
    const json ref2 = hf_reference(out, dir + "/ref2.json");
    EXPECT_EQ(ref2["loss"].get<double>(), ref["loss"].get<double>())
        << "the export must hold exactly the loaded values";
    EXPECT_EQ(ref2["greedy"], ref["greedy"]);
    GPT back(open_model_source(out).model);
    load_hf_weights(back.weights(), out);
    ASSERT_EQ(back.num_params(), m.num_params());
    EXPECT_EQ(0, std::memcmp(back.params(), m.params(), m.num_params() * sizeof(float)));
}

TEST(HfLlama, MemtrainLlamaRoundTripsThroughHfLayoutBitwise) {
    ModelConfig c;
    c.n_layer = 3;
    c.n_head = 4;
    c.n_kv_head = 1;
    c.n_embd = 32;
    c.block_size = 16;
    c.vocab_size = 70;
    c.norm = "rmsnorm";
    c.activation = "swiglu";
    c.positions = "rope";
    c.bias = false;
    for (bool tied : {false, true}) {
        c.tied_embeddings = tied;
        GPT m(c);
        m.init_weights(7);
        const std::string dir = test::temp_dir(tied ? "hf_llama_rt_tied" : "hf_llama_rt");
        save_hf_weights(m.weights(), dir + "/model.safetensors");
        std::ofstream(dir + "/config.json") << hf_config_json(c);
        auto f = io::SafetensorsFile::open(dir + "/model.safetensors");
        EXPECT_NE(f.find("model.layers.2.self_attn.k_proj.weight"), nullptr);
        EXPECT_EQ(f.get("model.layers.0.self_attn.k_proj.weight").shape,
                  (std::vector<int64_t>{8, 32}));
        EXPECT_EQ(f.get("model.embed_tokens.weight").shape, (std::vector<int64_t>{70, 32}));
        EXPECT_EQ(f.find("lm_head.weight") != nullptr, !tied);
        EXPECT_EQ(f.find("h.0.attn.c_attn.weight"), nullptr);
        const ModelConfig read = model_config_from_hf(dir + "/config.json");
        EXPECT_TRUE(read.is_llama());
        EXPECT_EQ(read.kv_heads(), 1);
        EXPECT_EQ(read.tied_embeddings, tied);
        GPT back(read);
        load_hf_weights(back.weights(), dir);
        ASSERT_EQ(back.num_params(), m.num_params());
        EXPECT_EQ(0, std::memcmp(back.params(), m.params(), m.num_params() * sizeof(float)));
    }
}

// Cached decoding gives the logits of the full forward at every position, for every family.
TEST(HfLlama, KvCacheLogitsEqualTheFullForward) {
    std::vector<ModelConfig> configs(2, test::tiny_model());
    configs[1].norm = "rmsnorm";
    configs[1].activation = "swiglu";
    configs[1].positions = "rope";
    configs[1].n_head = 4;
    configs[1].n_kv_head = 2;
    configs[1].bias = false;
    configs[1].tied_embeddings = false;
    for (const ModelConfig& c : configs) {
        GPT m(c);
        m.init_weights(3);
        const int T = c.block_size, V = c.vocab_size;
        const auto x = test::random_tokens(T, V, 11);
        std::vector<float> full((std::size_t)T * V), step(V);
        m.forward_logits(x.data(), 1, T, full.data());
        KvDecoder dec(c, m.layout(), m.params(), T);
        dec.append(std::span<const int32_t>(x.data(), 3), step.data());  // a prefill of 3
        for (int v = 0; v < V; v++) EXPECT_NEAR(step[v], full[2 * V + v], 1e-5);
        for (int t = 3; t < T; t++) {
            dec.append(std::span<const int32_t>(x.data() + t, 1), step.data());
            for (int v = 0; v < V; v++)
                ASSERT_NEAR(step[v], full[(std::size_t)t * V + v], 1e-5) << "position " << t;
        }
        EXPECT_THROW(dec.append(std::span<const int32_t>(x.data(), 1), step.data()), Error);
    }
}

TEST(HfLlama, UnsupportedConfigsAreRefusedByKey) {
    const std::string dir = test::temp_dir("hf_llama_bad");
    auto refused = [&](const std::string& text, const std::string& needle) {
        std::ofstream(dir + "/config.json") << text;
        try {
            model_config_from_hf(dir + "/config.json");
            ADD_FAILURE() << "accepted " << text;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
    };
    const std::string llama =
        R"("model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300)";
    refused("{" + llama + R"(, "num_local_experts": 8})", "mixture of experts");
    refused(R"({"model_type": "mixtral", "hidden_size": 64})", "mixtral");
    refused("{" + llama + R"(, "rope_scaling": {"rope_type": "llama3"}})", "rope_scaling");
    refused("{" + llama + R"(, "hidden_act": "gelu"})", "hidden_act");
    refused("{" + llama + R"(, "attention_bias": true})", "attention_bias");
    refused(R"({"model_type": "llama", "hidden_size": 64})", "num_hidden_layers");
    refused("{" + llama + R"(, "num_key_value_heads": 3})", "n_kv_head");
    refused("not json", "not valid JSON");
}

}  // namespace
}  // namespace memtrain
