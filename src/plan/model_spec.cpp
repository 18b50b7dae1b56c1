// Parameter counts from tensor shapes, model presets, and the config-file readers.
// Counts follow the engine's layout (model/param_layout.cpp) for GPT-2 and Hugging Face's
// LlamaForCausalLM for Llama, so 1.5B GPT-2 and Llama-2-7B come out at their published sizes.
#include "plan/model_spec.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/ranges.h>
#include <toml++/toml.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "plan/nearest.h"

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
    if (!bias) return 0;
    return n_embd + 2 * kv_dim() + (swiglu ? 2 : 1) * ffn();  // QKV and fc1 (column-parallel)
}

int64_t ModelSpec::layer_replicated_params() const {
    int64_t norms = 2LL * n_embd * (rmsnorm ? 1 : 2);
    int64_t row_bias = bias ? 2LL * n_embd : 0;  // out-proj and fc2 biases
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
    m.tied_embeddings = m.bias = m.dropout = false;
    return m;
}

const std::map<std::string, ModelSpec>& presets() {
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
        put(llama("llama2-7b", 32, 32, 32, 4096, 11008, 32000, 4096));
        put(llama("llama2-13b", 40, 40, 40, 5120, 13824, 32000, 4096));
        put(llama("llama2-70b", 80, 64, 8, 8192, 28672, 32000, 4096));
        put(llama("llama3-8b", 32, 32, 8, 4096, 14336, 128256, 8192));
        put(llama("llama3-70b", 80, 64, 8, 8192, 28672, 128256, 8192));
        put(llama("llama3-405b", 126, 128, 8, 16384, 53248, 128256, 8192));
        return t;
    }();
    return table;
}

std::string read_text(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("cannot open model file {}", path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() &&
           s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<std::string> model_preset_names() {
    std::vector<std::string> names;
    for (const auto& [k, v] : presets()) names.push_back(k);
    return names;
}

ModelSpec model_from_hf_json(const std::string& json_text, const std::string& origin) {
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(json_text);
    } catch (const std::exception& e) {
        fail("{}: not valid JSON ({})", origin, e.what());
    }
    if (!j.is_object()) fail("{}: expected a JSON object (a Hugging Face config.json)", origin);
    auto get_int = [&](const char* key, bool required, int fallback) -> int {
        if (!j.contains(key) || j[key].is_null()) {
            if (required) fail("{}: missing key \"{}\"", origin, key);
            return fallback;
        }
        if (!j[key].is_number_integer())
            fail("{}: key \"{}\" must be an integer, got {}", origin, key, j[key].dump());
        return j[key].get<int>();
    };
    ModelSpec m;
    m.name = origin;
    if (j.contains("n_layer")) {  // GPT-2 style keys
        m.n_layer = get_int("n_layer", true, 0);
        m.n_head = get_int("n_head", true, 0);
        m.n_embd = get_int("n_embd", true, 0);
        m.block_size = get_int("n_positions", false, 1024);
        m.vocab_size = get_int("vocab_size", true, 0);
        m.ffn_hidden = get_int("n_inner", false, 0);
    } else if (j.contains("num_hidden_layers")) {  // Llama style keys
        m = llama(origin, get_int("num_hidden_layers", true, 0),
                  get_int("num_attention_heads", true, 0), 0, get_int("hidden_size", true, 0), 0,
                  get_int("vocab_size", true, 0), get_int("max_position_embeddings", false, 4096));
        m.n_kv_head = get_int("num_key_value_heads", false, 0);
        m.ffn_hidden = get_int("intermediate_size", false, 0);
        if (j.contains("tie_word_embeddings") && j["tie_word_embeddings"].is_boolean())
            m.tied_embeddings = j["tie_word_embeddings"].get<bool>();
    } else {
        fail(
            "{}: neither GPT-2 keys (n_layer, n_head, n_embd) nor Llama keys "
            "(num_hidden_layers, hidden_size, num_attention_heads) found",
            origin);
    }
    m.validate();
    return m;
}

ModelSpec model_from_toml(const std::string& toml_text, const std::string& origin) {
    toml::table root;
    try {
        root = toml::parse(toml_text, origin);
    } catch (const toml::parse_error& e) {
        fail("{}: TOML parse error: {}", origin, std::string(e.description()));
    }
    const toml::table* model = root["model"].as_table();
    if (!model) fail("{}: no [model] section", origin);
    ModelSpec m;
    m.name = origin;
    auto get_int = [&](const char* key, int fallback) -> int {
        auto node = (*model)[key];
        if (!node) return fallback;
        auto v = node.value<int64_t>();
        if (!v) fail("{}: model.{} must be an integer", origin, key);
        return static_cast<int>(*v);
    };
    auto get_str = [&](const char* key, const char* fallback, std::vector<std::string> allowed) {
        auto node = (*model)[key];
        if (!node) return std::string(fallback);
        auto v = node.value<std::string>();
        if (!v) fail("{}: model.{} must be a string", origin, key);
        for (const auto& a : allowed)
            if (*v == a) return *v;
        fail("{}: model.{} = \"{}\" is not one of {}; did you mean \"{}\"?", origin, key, *v,
             fmt::format("{}", fmt::join(allowed, "|")), nearest_name(*v, allowed));
    };
    m.n_layer = get_int("n_layer", m.n_layer);
    m.n_head = get_int("n_head", m.n_head);
    m.n_embd = get_int("n_embd", m.n_embd);
    m.block_size = get_int("block_size", m.block_size);
    m.vocab_size = get_int("vocab_size", m.vocab_size);
    m.n_kv_head = get_int("n_kv_head", 0);
    m.ffn_hidden = get_int("ffn_hidden", 0);
    m.rmsnorm = get_str("norm", "layernorm", {"layernorm", "rmsnorm"}) == "rmsnorm";
    m.swiglu = get_str("activation", "gelu", {"gelu", "swiglu"}) == "swiglu";
    m.rope = get_str("positions", "learned", {"learned", "rope"}) == "rope";
    if (auto node = (*model)["tied_embeddings"]) {
        auto v = node.value<bool>();
        if (!v) fail("{}: model.tied_embeddings must be true or false", origin);
        m.tied_embeddings = *v;
    }
    if (auto node = (*model)["vocab_pad"]) {  // the engine allocates padded embedding rows
        auto pad = node.value<int64_t>();
        if (pad && *pad > 0)
            m.vocab_size = static_cast<int>((m.vocab_size + *pad - 1) / *pad * *pad);
    }
    // Llama-style blocks (RMSNorm) carry no biases in the engine; GPT-2 blocks do.
    m.bias = !m.rmsnorm;
    m.dropout = false;  // memtrain's trainer has no dropout
    m.validate();
    return m;
}

ModelSpec model_from_config(const ModelConfig& c) {
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
    m.bias = true;  // memtrain's blocks keep linear biases in every variant
    m.dropout = false;
    return m;
}

ModelSpec load_model(const std::string& name_or_path) {
    const auto& table = presets();
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
        "unknown model \"{}\"; did you mean \"{}\"? (presets: {}; or give a config.json or "
        "memtrain .toml path)",
        name_or_path, nearest_name(name_or_path, model_preset_names()),
        fmt::format("{}", fmt::join(model_preset_names(), ", ")));
}

}  // namespace memtrain::plan
