// Parameter counts from tensor shapes, model presets, and the config-file readers.
// Counts follow the engine's layout (model/param_layout.cpp) for GPT-2 and Hugging Face's
// LlamaForCausalLM for Llama, so 1.5B GPT-2 and Llama-2-7B come out at their published sizes.
#include "planner/model_shape.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/ranges.h>
#include <toml++/toml.h>
#include <nlohmann/json.hpp>

#include "config/run_config.h"
#include "core/error.h"
#include "core/regular_file.h"
#include "model/config.h"
#include "model/param_layout.h"
#include "planner/nearest.h"

namespace memtrain::plan {

int64_t ModelSpec::ffn() const {
    if (ffn_hidden > 0) return ffn_hidden;
    if (!swiglu) return 4LL * n_embd;
    // Llama keeps the MLP's parameter count near the 4h GELU one: 2/3 * 4h, rounded up to 256.
    int64_t f = 8LL * n_embd / 3;
    return (f + 255) / 256 * 256;
}

int64_t ModelSpec::layer_matrix_params() const {
    const int64_t h = n_embd;
    int64_t attn = h * h + 2 * h * kv_dim() + h * h;  // Q, K, V, out-projection
    int64_t mlp = (swiglu ? 3 : 2) * h * ffn();
    return attn + mlp;
}

int64_t ModelSpec::layer_split_bias_params() const {
    // QKV and fc1 (gate and up for SwiGLU) are column-parallel.
    int64_t attn = attn_bias ? n_embd + 2 * kv_dim() : 0;
    int64_t mlp = mlp_bias ? (swiglu ? 2 : 1) * ffn() : 0;
    return attn + mlp;
}

int64_t ModelSpec::layer_replicated_params() const {
    int64_t norms = 2LL * n_embd * (rmsnorm ? 1 : 2);
    int64_t row_bias = (attn_bias ? n_embd : 0) + (mlp_bias ? n_embd : 0);  // out-proj, fc2
    return norms + row_bias;
}

int64_t ModelSpec::layer_params() const {
    return layer_matrix_params() + layer_split_bias_params() + layer_replicated_params();
}

int64_t ModelSpec::embedding_params() const {
    int64_t tok = static_cast<int64_t>(vocab_size) * n_embd;
    return tok + (rope ? 0 : static_cast<int64_t>(block_size) * n_embd);
}

int64_t ModelSpec::head_params() const {
    int64_t norm = static_cast<int64_t>(n_embd) * (rmsnorm ? 1 : 2);
    return norm + (tied_embeddings ? 0 : static_cast<int64_t>(vocab_size) * n_embd);
}

int64_t ModelSpec::total_params() const {
    return embedding_params() + n_layer * layer_params() + head_params();
}

int64_t ModelSpec::matmul_params() const {
    return n_layer * layer_matrix_params() + static_cast<int64_t>(vocab_size) * n_embd;
}

void ModelSpec::validate() const {
    if (n_layer <= 0) fail("model {}: n_layer must be positive, got {}", name, n_layer);
    if (n_head <= 0) fail("model {}: n_head must be positive, got {}", name, n_head);
    if (n_embd <= 0) fail("model {}: n_embd must be positive, got {}", name, n_embd);
    if (vocab_size <= 0) fail("model {}: vocab_size must be positive, got {}", name, vocab_size);
    if (block_size <= 0) fail("model {}: block_size must be positive, got {}", name, block_size);
    if (n_embd % n_head != 0)
        fail("model {}: n_embd {} is not divisible by n_head {}", name, n_embd, n_head);
    if (n_kv_head < 0 || (n_kv_head > 0 && n_head % n_kv_head != 0))
        fail("model {}: n_head {} is not a multiple of n_kv_head {}", name, n_head, n_kv_head);
    if (ffn_hidden < 0) fail("model {}: ffn_hidden must be >= 0, got {}", name, ffn_hidden);
    // The engine's bounds (model/config.h), so the products below stay far inside 64 bits.
    auto at_most = [&](const char* key, int v, int limit) {
        if (v > limit)
            fail("model {}: {} = {} is more than memtrain supports ({} at most)", name, key, v,
                 limit);
    };
    at_most("n_layer", n_layer, kMaxLayers);
    at_most("n_embd", n_embd, kMaxWidth);
    at_most("block_size", block_size, kMaxContext);
    at_most("vocab_size", vocab_size, kMaxVocab);
    at_most("ffn_hidden", ffn_hidden, kMaxHidden);
}

namespace {

ModelSpec gpt2(std::string name, int layers, int heads, int width) {
    ModelSpec m;
    m.name = std::move(name);
    m.n_layer = layers, m.n_head = heads, m.n_embd = width;
    m.vocab_size = 50257, m.block_size = 1024;
    return m;
}

ModelSpec llama(std::string name, int layers, int heads, int kv, int width, int ffn, int vocab,
                int ctx) {
    ModelSpec m;
    m.name = std::move(name);
    m.n_layer = layers, m.n_head = heads, m.n_kv_head = kv, m.n_embd = width;
    m.ffn_hidden = ffn, m.vocab_size = vocab, m.block_size = ctx;
    m.rmsnorm = m.swiglu = m.rope = true;
    m.tied_embeddings = m.attn_bias = m.mlp_bias = m.dropout = false;
    return m;
}

const std::map<std::string, ModelSpec>& model_presets() {
    static const std::map<std::string, ModelSpec> table = [] {
        std::map<std::string, ModelSpec> t;
        auto put = [&](ModelSpec m) { t[m.name] = m; };
        put(gpt2("gpt2", 12, 12, 768));
        put(gpt2("gpt2-medium", 24, 16, 1024));
        put(gpt2("gpt2-large", 36, 20, 1280));
        put(gpt2("gpt2-xl", 48, 25, 1600));
        ModelSpec g3 = gpt2("gpt3-175b", 96, 96, 12288);
        g3.block_size = 2048;
        put(g3);
        // LLaMA 1 (Touvron et al. 2023, table 2): 32.5B and 65.2B parameters, 2048 context.
        for (ModelSpec m : {llama("llama-30b", 60, 52, 52, 6656, 17920, 32000, 2048),
                            llama("llama-65b", 80, 64, 64, 8192, 22016, 32000, 2048)}) {
            m.norm_eps = 1e-6;  // LLaMA 1's rms_norm_eps
            put(m);
        }
        put(llama("llama2-7b", 32, 32, 32, 4096, 11008, 32000, 4096));
        put(llama("llama2-13b", 40, 40, 40, 5120, 13824, 32000, 4096));
        put(llama("llama2-70b", 80, 64, 8, 8192, 28672, 32000, 4096));
        for (ModelSpec m : {llama("llama3-8b", 32, 32, 8, 4096, 14336, 128256, 8192),
                            llama("llama3-70b", 80, 64, 8, 8192, 28672, 128256, 8192),
                            llama("llama3-405b", 126, 128, 8, 16384, 53248, 128256, 8192)}) {
            m.rope_theta = 500000;  // Llama 3's config.json
            put(m);
        }
        return t;
    }();
    return table;
}

// A config.json or TOML is a few KB: a FIFO, /dev/zero or a huge file is refused, not read.
std::string read_text(const std::string& path) {
    return read_regular_file(path, kMaxConfigBytes, "model file");
}

bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() &&
           s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<std::string> model_preset_names() {
    std::vector<std::string> names;
    for (const auto& [k, v] : model_presets()) names.push_back(k);
    return names;
}

std::vector<std::string> supported_model_types() {
    return {"gpt2", "llama", "mistral", "memtrain-llama-style"};
}

namespace {

// Architectures whose feed-forward is a mixture of experts: their parameter count and memory
// are not a dense model's, so a dense estimate would be wrong by a large factor.
bool is_moe_type(const std::string& type) {
    static const char* const kMoe[] = {"mixtral",
                                       "qwen2_moe",
                                       "qwen3_moe",
                                       "deepseek_v2",
                                       "deepseek_v3",
                                       "dbrx",
                                       "jamba",
                                       "olmoe",
                                       "phimoe",
                                       "granitemoe",
                                       "jetmoe",
                                       "arctic",
                                       "gpt_oss",
                                       "llama4",
                                       "minimax",
                                       "nllb_moe",
                                       "switch_transformers",
                                       "grok",
                                       "qwen3_next",
                                       "ernie4_5_moe"};
    for (const char* t : kMoe)
        if (type == t) return true;
    return false;
}

// The first key that marks experts (num_experts, n_routed_experts, moe_*, ...) with a value
// that asks for them, or "" for a dense config.
std::string moe_key(const nlohmann::json& j) {
    static const char* const kKeys[] = {"num_local_experts", "num_experts",
                                        "n_routed_experts",  "num_experts_per_tok",
                                        "n_shared_experts",  "ffn_config"};
    auto wants_experts = [](const nlohmann::json& v) {
        if (v.is_null()) return false;
        if (v.is_number()) return v.get<double>() > 0;
        if (v.is_boolean()) return v.get<bool>();
        return true;
    };
    for (const char* k : kKeys)
        if (j.contains(k) && wants_experts(j[k])) return k;
    for (const auto& [k, v] : j.items())
        if (k.rfind("moe_", 0) == 0 && wants_experts(v)) return k;
    return "";
}

std::string supported_list() {
    return fmt::format("{}", fmt::join(supported_model_types(), ", "));
}

class JsonReader {
  public:
    JsonReader(const nlohmann::json& j, const std::string& origin) : j_(j), origin_(origin) {}

    bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
    int get_int(const char* key) const {
        if (!has(key)) fail("{}: missing key \"{}\"", origin_, key);
        if (!j_[key].is_number_integer())
            fail("{}: key \"{}\" must be an integer, got {}", origin_, key, j_[key].dump());
        const int64_t v = j_[key].get<int64_t>();
        if (v < INT32_MIN || v > INT32_MAX)
            fail("{}: key \"{}\" = {} is out of range", origin_, key, v);
        return (int)v;
    }
    int get_int(const char* key, int fallback) const { return has(key) ? get_int(key) : fallback; }
    bool get_bool(const char* key, bool fallback) const {
        if (!has(key)) return fallback;
        if (!j_[key].is_boolean())
            fail("{}: key \"{}\" must be true or false, got {}", origin_, key, j_[key].dump());
        return j_[key].get<bool>();
    }
    double get_number(const char* key, double fallback) const {
        if (!has(key)) return fallback;
        if (!j_[key].is_number())
            fail("{}: key \"{}\" must be a number, got {}", origin_, key, j_[key].dump());
        return j_[key].get<double>();
    }
    std::string get_choice(const char* key, const std::vector<std::string>& allowed) const {
        if (!has(key)) fail("{}: missing key \"{}\"", origin_, key);
        if (!j_[key].is_string())
            fail("{}: key \"{}\" must be a string, got {}", origin_, key, j_[key].dump());
        std::string v = j_[key].get<std::string>();
        for (const auto& a : allowed)
            if (v == a) return v;
        fail("{}: key \"{}\" = \"{}\" is not one of {}", origin_, key, v,
             fmt::format("{}", fmt::join(allowed, "|")));
    }

  private:
    const nlohmann::json& j_;
    const std::string& origin_;
};

// Hugging Face GPT2LMHeadModel (what memtrain writes for a GPT-2 architecture).
ModelSpec read_gpt2(const JsonReader& r, const std::string& origin) {
    ModelSpec m;
    m.name = origin;
    m.n_layer = r.get_int("n_layer");
    m.n_head = r.get_int("n_head");
    m.n_embd = r.get_int("n_embd");
    m.vocab_size = r.get_int("vocab_size");
    m.block_size = r.get_int("n_positions", r.get_int("n_ctx", 1024));
    m.ffn_hidden = r.get_int("n_inner", 0);
    m.tied_embeddings = r.get_bool("tie_word_embeddings", true);
    m.norm_eps = r.get_number("layer_norm_epsilon", 1e-5);
    // Hugging Face's GPT-2 defaults to 0.1 dropout; memtrain's checkpoints say 0.0 (no masks).
    m.dropout = false;
    for (const char* k : {"resid_pdrop", "embd_pdrop", "attn_pdrop"})
        m.dropout = m.dropout || r.get_number(k, 0.1) > 0;
    return m;
}

// Hugging Face LlamaForCausalLM and MistralForCausalLM: the same tensors (Mistral's sliding
// window changes no shape).
ModelSpec read_llama(const JsonReader& r, const std::string& origin) {
    // One key at a time, so a missing one is named in a fixed order.
    const int layers = r.get_int("num_hidden_layers"), heads = r.get_int("num_attention_heads");
    const int width = r.get_int("hidden_size"), ffn = r.get_int("intermediate_size");
    const int vocab = r.get_int("vocab_size");
    ModelSpec m = llama(origin, layers, heads, 0, width, ffn, vocab,
                        r.get_int("max_position_embeddings", 4096));
    m.n_kv_head = r.get_int("num_key_value_heads", 0);
    m.tied_embeddings = r.get_bool("tie_word_embeddings", false);
    m.attn_bias = r.get_bool("attention_bias", false);
    m.mlp_bias = r.get_bool("mlp_bias", false);
    m.norm_eps = r.get_number("rms_norm_eps", 1e-6);
    m.rope_theta = r.get_number("rope_theta", 10000.0);
    if (r.has("head_dim") && m.n_head > 0 && (int64_t)r.get_int("head_dim") * m.n_head != m.n_embd)
        fail(
            "{}: head_dim {} x num_attention_heads {} != hidden_size {}; the planner models "
            "heads of hidden_size / num_attention_heads",
            origin, r.get_int("head_dim"), m.n_head, m.n_embd);
    return m;
}

// memtrain's own config.json for a non-GPT-2 architecture (io/checkpoint.cpp hf_config_json):
// every choice is a key, and the blocks keep the engine's linear biases.
ModelSpec read_memtrain(const JsonReader& r, const std::string& origin) {
    ModelConfig c;
    c.n_layer = r.get_int("n_layer");
    c.n_head = r.get_int("n_head");
    c.n_embd = r.get_int("n_embd");
    c.vocab_size = r.get_int("vocab_size");
    c.vocab_pad = 1;  // the checkpoint's tensors have vocab_size rows, not the padded ones
    c.block_size = r.get_int("n_positions");
    c.n_kv_head = r.get_int("n_kv_head", 0);
    c.ffn_hidden = r.get_int("ffn_hidden", 0);
    c.norm = r.get_choice("norm", {"layernorm", "rmsnorm"});
    c.activation = r.get_choice("activation", {"gelu", "swiglu"});
    c.positions = r.get_choice("positions", {"learned", "rope"});
    c.tied_embeddings = r.get_bool("tie_word_embeddings", true);
    ModelSpec m = model_from_config(c);
    m.name = origin;
    return m;
}

}  // namespace

ModelSpec model_from_hf_json(const std::string& json_text, const std::string& origin) {
    nlohmann::json j;
    check_json_nesting(json_text, 64, origin);  // (error messages dump values: bounded depth)
    try {
        j = nlohmann::json::parse(json_text);
    } catch (const nlohmann::json::parse_error& e) {
        // The byte, not the text there: the file may be something else than a config.json.
        fail("{}: not valid JSON (parse error at byte {})", origin, e.byte);
    } catch (const std::exception&) {
        fail("{}: not valid JSON", origin);
    }
    if (!j.is_object()) fail("{}: expected a JSON object (a Hugging Face config.json)", origin);
    JsonReader r(j, origin);
    std::string type;
    if (r.has("model_type")) {
        if (!j["model_type"].is_string())
            fail("{}: key \"model_type\" must be a string, got {}", origin, j["model_type"].dump());
        type = j["model_type"].get<std::string>();
    }
    const std::string experts = moe_key(j);
    if (is_moe_type(type) || !experts.empty())
        fail(
            "{}: model_type \"{}\" is a mixture-of-experts model{}; the planner models dense "
            "transformers only (supported model_type: {})",
            origin, type.empty() ? "(none)" : type,
            experts.empty() ? "" : fmt::format(" (key \"{}\" = {})", experts, j[experts].dump()),
            supported_list());
    ModelSpec m;
    if (type == "gpt2") {
        m = read_gpt2(r, origin);
    } else if (type == "llama" || type == "mistral") {
        m = read_llama(r, origin);
    } else if (type == "memtrain-llama-style") {
        m = read_memtrain(r, origin);
    } else if (!type.empty()) {
        fail("{}: model_type \"{}\" is not supported; the planner reads model_type {}", origin,
             type, supported_list());
    } else if (j.contains("n_layer")) {  // no model_type: GPT-2 style keys
        m = read_gpt2(r, origin);
    } else if (j.contains("num_hidden_layers")) {  // no model_type: Llama style keys
        m = read_llama(r, origin);
    } else {
        fail(
            "{}: no model_type, and neither GPT-2 keys (n_layer, n_head, n_embd) nor Llama keys "
            "(num_hidden_layers, hidden_size, num_attention_heads) found (supported model_type: "
            "{})",
            origin, supported_list());
    }
    m.validate();
    return m;
}

ModelSpec model_from_toml(const std::string& toml_text, const std::string& origin) {
    toml::table root;
    try {
        check_toml_text(toml_text, origin);
        root = toml::parse(toml_text, origin);
    } catch (const toml::parse_error& e) {
        fail("{}:{}:{}: invalid TOML", origin, e.source().begin.line, e.source().begin.column);
    }
    const toml::table* model = root["model"].as_table();
    if (!model) fail("{}: no [model] section", origin);
    // The engine's defaults and layout (padded vocabulary, linear biases) come with ModelConfig,
    // so the count is what `memtrain train` allocates for this file.
    ModelConfig c;
    auto get_int = [&](const char* key, int fallback) -> int {
        auto node = (*model)[key];
        if (!node) return fallback;
        auto v = node.value<int64_t>();
        if (!v || *v < INT32_MIN || *v > INT32_MAX)
            fail("{}: model.{} must be an integer of 32 bits", origin, key);
        return static_cast<int>(*v);
    };
    auto get_str = [&](const char* key, const std::string& fallback,
                       std::vector<std::string> allowed) {
        auto node = (*model)[key];
        if (!node) return fallback;
        auto v = node.value<std::string>();
        if (!v) fail("{}: model.{} must be a string", origin, key);
        for (const auto& a : allowed)
            if (*v == a) return *v;
        fail("{}: model.{} = \"{}\" is not one of {}; did you mean \"{}\"?", origin, key, *v,
             fmt::format("{}", fmt::join(allowed, "|")), nearest_name(*v, allowed));
    };
    c.n_layer = get_int("n_layer", c.n_layer);
    c.n_head = get_int("n_head", c.n_head);
    c.n_embd = get_int("n_embd", c.n_embd);
    c.block_size = get_int("block_size", c.block_size);
    c.vocab_size = get_int("vocab_size", c.vocab_size);
    c.vocab_pad = get_int("vocab_pad", c.vocab_pad);
    if (c.vocab_pad < 1) fail("{}: model.vocab_pad must be >= 1, got {}", origin, c.vocab_pad);
    c.n_kv_head = get_int("n_kv_head", 0);
    c.ffn_hidden = get_int("ffn_hidden", 0);
    c.norm = get_str("norm", c.norm, {"layernorm", "rmsnorm"});
    c.activation = get_str("activation", c.activation, {"gelu", "swiglu"});
    c.positions = get_str("positions", c.positions, {"learned", "rope"});
    auto get_bool = [&](const char* key, bool& out) {
        if (auto node = (*model)[key]) {
            auto v = node.value<bool>();
            if (!v) fail("{}: model.{} must be true or false", origin, key);
            out = *v;
        }
    };
    auto get_number = [&](const char* key, double& out) {
        if (auto node = (*model)[key]) {
            auto v = node.value<double>();
            if (!v) fail("{}: model.{} must be a number", origin, key);
            out = *v;
        }
    };
    get_bool("tied_embeddings", c.tied_embeddings);
    get_bool("bias", c.bias);  // which linear biases exist: the parameter count
    get_number("norm_eps", c.norm_eps);
    get_number("rope_theta", c.rope_theta);
    ModelSpec m = model_from_config(c);
    m.name = origin;
    m.validate();
    return m;
}

ModelSpec model_from_config(const ModelConfig& c) {
    c.check_bounds();  // every size below fits its type
    ModelSpec m;
    m.name = "config";
    m.n_layer = c.n_layer, m.n_head = c.n_head, m.n_embd = c.n_embd;
    m.n_kv_head = c.n_kv_head, m.block_size = c.block_size;
    m.vocab_size = c.padded_vocab();
    m.rmsnorm = c.norm == "rmsnorm";
    m.swiglu = c.activation == "swiglu";
    m.rope = c.positions == "rope";
    m.tied_embeddings = c.tied_embeddings;
    m.ffn_hidden = c.mlp_hidden();
    // Which linear biases a block has is the engine's parameter layout's to say.
    bool attn_bias = false, mlp_bias = false;
    if (c.n_layer > 0 && c.n_head > 0 && c.n_embd > 0) {
        ModelConfig one = c;
        one.n_layer = 1;
        for (const auto& t : make_param_layout(one).tensors) {
            attn_bias = attn_bias || t.name == "h.0.attn.c_attn.bias";
            mlp_bias = mlp_bias || t.name == "h.0.mlp.c_fc.bias";
        }
    }
    m.attn_bias = attn_bias, m.mlp_bias = mlp_bias;
    m.dropout = false;  // model.dropout stores no masks (kernels/dropout_mask.h hashes them)
    m.norm_eps = c.norm_eps, m.rope_theta = c.rope_theta;
    return m;
}

ModelConfig config_from_model(const ModelSpec& m) {
    ModelConfig c;
    c.n_layer = m.n_layer, c.n_head = m.n_head, c.n_embd = m.n_embd;
    c.n_kv_head = m.n_kv_head, c.block_size = m.block_size;
    c.vocab_size = m.vocab_size;
    c.vocab_pad = 1;
    c.norm = m.rmsnorm ? "rmsnorm" : "layernorm";
    c.activation = m.swiglu ? "swiglu" : "gelu";
    c.positions = m.rope ? "rope" : "learned";
    c.tied_embeddings = m.tied_embeddings;
    c.ffn_hidden = static_cast<int>(m.ffn());
    c.bias = m.attn_bias || m.mlp_bias;
    c.norm_eps = m.norm_eps, c.rope_theta = m.rope_theta;
    return c;
}

ModelSpec load_model(const std::string& name_or_path) {
    const auto& table = model_presets();
    if (auto it = table.find(name_or_path); it != table.end()) return it->second;
    bool looks_like_file = ends_with(name_or_path, ".json") || ends_with(name_or_path, ".toml") ||
                           name_or_path.find('/') != std::string::npos;
    if (looks_like_file || std::filesystem::exists(name_or_path)) {
        if (std::filesystem::is_directory(name_or_path)) {
            auto cfg = std::filesystem::path(name_or_path) / "config.json";
            return model_from_hf_json(read_text(cfg.string()), cfg.string());
        }
        std::string text = read_text(name_or_path);
        if (ends_with(name_or_path, ".toml")) return model_from_toml(text, name_or_path);
        return model_from_hf_json(text, name_or_path);
    }
    fail(
        "unknown model \"{}\"; did you mean {}? (presets: {}; or give a config.json or "
        "memtrain .toml path)",
        name_or_path,
        did_you_mean(name_or_path, model_preset_names(),
                     {{"gpt2-small", "gpt2"},
                      {"gpt2-124m", "gpt2"},
                      {"gpt2-355m", "gpt2-medium"},
                      {"gpt2-350m", "gpt2-medium"},
                      {"gpt2-774m", "gpt2-large"},
                      {"gpt2-1.5b", "gpt2-xl"},
                      {"gpt2-1558m", "gpt2-xl"},
                      {"gpt3", "gpt3-175b"},
                      {"llama-2-7b", "llama2-7b"},
                      {"llama-2-13b", "llama2-13b"},
                      {"llama-2-70b", "llama2-70b"},
                      {"llama-3-8b", "llama3-8b"},
                      {"llama3.1-8b", "llama3-8b"},
                      {"llama-3.1-8b", "llama3-8b"},
                      {"llama-3-70b", "llama3-70b"},
                      {"llama3.1-70b", "llama3-70b"},
                      {"llama-3.1-405b", "llama3-405b"},
                      {"llama3.1-405b", "llama3-405b"}}),
        fmt::format("{}", fmt::join(model_preset_names(), ", ")));
}

}  // namespace memtrain::plan
