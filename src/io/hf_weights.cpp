// Hugging Face weights and config.json in and out (see hf_weights.h).
#include "io/hf_weights.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer.h"
#include "io/text_file.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace memtrain {

namespace {

// config.json and model.safetensors.index.json: at most 1 MiB (a 405B model's index is a
// tenth of that), not a FIFO or a device, nested at most 64 deep. A parse error names the byte,
// never the text there: the file may be something other than the JSON it is named as.
json parse_json_file(const fs::path& path) {
    const std::string text = io::read_text_file(path, kMaxConfigBytes);
    check_json_nesting(text, 64, path.string());
    try {
        return json::parse(text);
    } catch (const json::parse_error& e) {
        fail("{} is not valid JSON (parse error at byte {})", path.string(), e.byte);
    } catch (const json::exception&) {
        // A number too large for a double (1e999) is out_of_range, not a parse error; its
        // message would quote the number (found by fuzz_config_json).
        fail("{} is not valid JSON (a number out of range)", path.string());
    }
}

int64_t numel(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
}

}  // namespace

HfTensorSource HfTensorSource::open(const std::string& path) {
    fs::path p(path);
    if (!fs::exists(p)) fail("model weights {} do not exist", path);
    if (fs::is_directory(p)) {
        if (fs::exists(p / "model.safetensors"))
            p /= "model.safetensors";
        else if (fs::exists(p / "model.safetensors.index.json"))
            p /= "model.safetensors.index.json";
        else
            fail("{} holds neither model.safetensors nor model.safetensors.index.json", path);
    }
    HfTensorSource src;
    src.path_ = p.string();
    auto add_file = [&](const fs::path& file) {
        src.files_.push_back(io::SafetensorsFile::open(file.string()));
        return src.files_.size() - 1;
    };
    if (p.extension() != ".json") {
        std::size_t i = add_file(p);
        for (const auto& t : src.files_[i].tensors()) src.where_.emplace(t.name, i);
        return src;
    }
    // A sharded model: the index maps every tensor to the file (beside the index) holding it.
    json index = parse_json_file(p);
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
        fail("{}: expected a JSON object with a \"weight_map\" object (tensor name -> file)", path);
    std::map<std::string, std::size_t> file_index;
    for (const auto& [name, file] : index["weight_map"].items()) {
        if (!file.is_string())
            fail("{}: weight_map[\"{}\"] must be a file name, it is {}", path, name, file.dump());
        const std::string f = file.get<std::string>();
        if (f.find('/') != std::string::npos || f == ".." || f.empty())
            fail("{}: weight_map[\"{}\"] = \"{}\" must name a file beside the index", path, name,
                 f);
        auto it = file_index.find(f);
        if (it == file_index.end()) {
            const fs::path shard = p.parent_path() / f;
            if (!fs::exists(shard))
                fail("{}: weight_map names shard {}, which does not exist", path, shard.string());
            it = file_index.emplace(f, add_file(shard)).first;
        }
        if (!src.files_[it->second].find(name))
            fail("{}: weight_map puts tensor '{}' in {}, which has no such tensor", path, name, f);
        src.where_.emplace(name, it->second);
    }
    if (src.where_.empty()) fail("{}: weight_map is empty", path);
    return src;
}

void HfTensorSource::read(std::string_view name, std::span<float> out,
                          std::span<const int64_t> shape) const {
    auto it = where_.find(name);
    if (it == where_.end()) fail("{} has no tensor '{}'", path_, name);
    const io::SafetensorsFile& f = files_[it->second];
    f.read_f32(f.get(name), out, name, shape);
}

std::vector<std::string> HfTensorSource::names() const {
    std::vector<std::string> out;
    out.reserve(where_.size());
    for (const auto& [name, file] : where_) out.push_back(name);
    return out;
}

HfNaming hf_naming(const ModelConfig& cfg) {
    return cfg.is_llama() ? HfNaming::Llama : HfNaming::Gpt2;
}

std::vector<HfPiece> hf_pieces(const ModelConfig& cfg, HfNaming naming) {
    const int64_t C = cfg.n_embd, V = cfg.vocab_size, H = cfg.mlp_hidden(),
                  KV = (int64_t)cfg.kv_heads() * cfg.head_dim();
    std::vector<HfPiece> pieces;
    if (naming == HfNaming::Gpt2) {
        for (const ParamSpec& t : make_param_layout(cfg).tensors) {
            auto shape = t.shape;
            if (t.name == "wte.weight" || t.name == "lm_head.weight") shape[0] = V;
            pieces.push_back({t.name, shape, t.name});
        }
        return pieces;
    }
    if (!cfg.is_llama())
        fail(
            "Hugging Face Llama names need a Llama model (model.norm = \"rmsnorm\", "
            "model.activation = \"swiglu\", model.positions = \"rope\", model.bias = false); this "
            "one has norm = \"{}\", activation = \"{}\", positions = \"{}\", bias = {}",
            cfg.norm, cfg.activation, cfg.positions, cfg.bias);
    pieces.push_back({"model.embed_tokens.weight", {V, C}, "wte.weight"});
    for (int l = 0; l < cfg.n_layer; l++) {
        const std::string p = fmt::format("model.layers.{}.", l), h = fmt::format("h.{}.", l);
        pieces.push_back({p + "input_layernorm.weight", {C}, h + "ln_1.weight"});
        pieces.push_back(
            {p + "self_attn.q_proj.weight", {C, C}, h + "attn.c_attn.weight", true, 0});
        pieces.push_back(
            {p + "self_attn.k_proj.weight", {KV, C}, h + "attn.c_attn.weight", true, C});
        pieces.push_back(
            {p + "self_attn.v_proj.weight", {KV, C}, h + "attn.c_attn.weight", true, C + KV});
        pieces.push_back(
            {p + "self_attn.o_proj.weight", {C, C}, h + "attn.c_proj.weight", true, 0});
        pieces.push_back({p + "post_attention_layernorm.weight", {C}, h + "ln_2.weight"});
        pieces.push_back({p + "mlp.gate_proj.weight", {H, C}, h + "mlp.c_fc.weight", true, 0});
        pieces.push_back({p + "mlp.up_proj.weight", {H, C}, h + "mlp.c_fc.weight", true, H});
        pieces.push_back({p + "mlp.down_proj.weight", {C, H}, h + "mlp.c_proj.weight", true, 0});
    }
    pieces.push_back({"model.norm.weight", {C}, "ln_f.weight"});
    if (!cfg.tied_embeddings) pieces.push_back({"lm_head.weight", {V, C}, "lm_head.weight"});
    return pieces;
}

namespace {

// The unit holding memtrain tensor `name`, and the tensor.
std::pair<int, const ParamSpec*> locate(const ParamLayout& layout, const std::string& name) {
    const ParamSpec& t = layout.get(name);
    for (int u = 0; u < (int)layout.units.size(); u++)
        if (t.offset >= layout.units[u].begin && t.offset < layout.units[u].end) return {u, &t};
    fail("internal: tensor {} lies in no parameter unit", name);
}

// A transposed piece: HF (rows, in) <-> columns [col0, col0 + rows) of ours (in, out).
void scatter_transposed(float* ours, const ParamSpec& t, const HfPiece& p, const float* hf) {
    const int64_t in = t.shape[0], out = t.shape[1], rows = p.shape[0];
    for (int64_t i = 0; i < in; i++)
        for (int64_t r = 0; r < rows; r++) ours[i * out + p.col0 + r] = hf[r * in + i];
}
void gather_transposed(float* hf, const ParamSpec& t, const HfPiece& p, const float* ours) {
    const int64_t in = t.shape[0], out = t.shape[1], rows = p.shape[0];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < in; i++) hf[r * in + i] = ours[i * out + p.col0 + r];
}

}  // namespace

void save_hf_weights(const ModelWeights& weights, const std::string& path, bool write) {
    WeightWindow& store = weights.store;
    const ParamLayout& layout = weights.layout;
    if (!write) {
        // Take part in the gathers the writing rank makes, in the same order.
        for (int u = 0; u < (int)layout.units.size(); u++) {
            store.acquire(u);
            store.release(u);
        }
        return;
    }
    const std::vector<HfPiece> pieces = hf_pieces(weights.cfg, hf_naming(weights.cfg));
    io::SafetensorsWriter w;
    w.set_metadata("format", "pt");
    std::vector<std::pair<int, const ParamSpec*>> where;
    for (const HfPiece& p : pieces) {
        w.declare(p.name, io::DType::F32, p.shape);
        where.push_back(locate(layout, p.ours));
    }
    int held = -1;
    const float* base = nullptr;
    std::vector<float> staging;
    auto release = [&] {
        if (held >= 0) store.release(held);
        held = -1;
    };
    try {
        // Pieces come in unit order, so each unit is acquired once, as the other ranks do.
        w.write(path, [&](std::size_t i) -> const void* {
            const auto [u, t] = where[i];
            if (u != held) {
                const int previous = held;
                release();
                // Every rank acquires every unit once, in order (the gathers are collectives).
                for (int skipped = previous + 1; skipped < u; skipped++) {
                    store.acquire(skipped);
                    store.release(skipped);
                }
                base = store.acquire(u);
                held = u;
            }
            const float* ours = base + (t->offset - layout.units[u].begin);
            if (!pieces[i].transposed) return ours;
            staging.resize((std::size_t)numel(pieces[i].shape));
            gather_transposed(staging.data(), *t, pieces[i], ours);
            return staging.data();
        });
        for (int u = held + 1; u < (int)layout.units.size(); u++) {
            release();
            store.acquire(u);
            held = u;
        }
    } catch (...) {
        release();
        throw;
    }
    release();
}

namespace {

// Tensors a Hugging Face file may carry that are not weights of the model: GPT-2's causal-mask
// buffers, Llama's rotary inverse frequencies, and lm_head written beside a tied embedding.
bool hf_buffer(const std::string& name, const ModelConfig& cfg) {
    auto ends = [&](std::string_view tail) {
        return name.size() >= tail.size() &&
               name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    return ends(".attn.bias") || ends(".attn.masked_bias") || ends("rotary_emb.inv_freq") ||
           (cfg.tied_embeddings && name == "lm_head.weight");
}

// The blocks a source holds: one more than the largest N of h.N. / model.layers.N. (0: none).
int source_blocks(const std::vector<std::string>& names) {
    int blocks = 0;
    for (const std::string& n : names)
        for (std::string_view prefix : {"h.", "transformer.h.", "model.layers."})
            if (n.rfind(prefix, 0) == 0) {
                const std::size_t at = prefix.size(), dot = n.find('.', at);
                if (dot == std::string::npos || dot == at || dot - at > 6) continue;
                if (n.find_first_not_of("0123456789", at) != dot) continue;
                blocks = std::max(blocks, std::stoi(n.substr(at, dot - at)) + 1);
            }
    return blocks;
}

// With refuse_unused: every tensor of `src` is one of `used` or a buffer (hf_buffer).
void check_every_tensor_used(const HfTensorSource& src, const std::set<std::string>& used,
                             const ModelConfig& cfg) {
    const std::vector<std::string> names = src.names();
    std::vector<std::string> unused;
    for (const std::string& n : names)
        if (!used.count(n) && !hf_buffer(n, cfg)) unused.push_back(n);
    if (unused.empty()) return;
    std::string listed;
    for (std::size_t i = 0; i < unused.size() && i < 4; i++) listed += (i ? ", " : "") + unused[i];
    if (unused.size() > 4) listed += ", ...";
    const int blocks = source_blocks(names);
    fail(
        "model.init_from = {} holds {} tensor{} this model does not use ({}){}. Describe the "
        "source's model in [model] (or leave [model] out to take its config.json), or set "
        "model.init_partial = true to load only the tensors this model has",
        src.path(), unused.size(), unused.size() == 1 ? "" : "s", listed,
        blocks > cfg.n_layer
            ? fmt::format(": it has {} blocks, model.n_layer = {}", blocks, cfg.n_layer)
            : std::string());
}

}  // namespace

void load_hf_weights(const ModelWeights& weights, const std::string& path, bool refuse_unused) {
    const HfTensorSource src = HfTensorSource::open(path);
    const ModelConfig& cfg = weights.cfg;
    const ParamLayout& layout = weights.layout;
    WeightWindow& store = weights.store;
    const HfNaming naming = src.has("model.embed_tokens.weight") ? HfNaming::Llama : HfNaming::Gpt2;
    const std::vector<HfPiece> pieces = hf_pieces(cfg, naming);
    if (refuse_unused) {  // before a byte is read: a mismatch is a config mistake
        std::set<std::string> used;
        for (const HfPiece& p : pieces)
            used.insert(naming == HfNaming::Gpt2 && !src.has(p.name) &&
                                src.has("transformer." + p.name)
                            ? "transformer." + p.name
                            : p.name);
        check_every_tensor_used(src, used, cfg);
    }
    std::vector<float> staging;
    std::size_t next = 0;
    for (int u = 0; u < (int)layout.units.size(); u++) {
        const ParamUnit& unit = layout.units[u];
        float* base = store.acquire(u, true);
        try {
            for (; next < pieces.size(); next++) {
                const HfPiece& p = pieces[next];
                const auto [pu, t] = locate(layout, p.ours);
                if (pu != u) break;
                std::string name = p.name;
                if (naming == HfNaming::Gpt2 && !src.has(name) && src.has("transformer." + name))
                    name = "transformer." + name;
                if (!src.has(name))
                    fail("{} has no tensor '{}'{}: not a {} checkpoint of this shape", src.path(),
                         p.name,
                         naming == HfNaming::Gpt2 ? " (nor 'transformer." + p.name + "')" : "",
                         naming == HfNaming::Gpt2 ? "GPT-2" : "Llama");
                float* ours = base + (t->offset - unit.begin);
                const std::size_t n = (std::size_t)numel(p.shape);
                if (!p.transposed) {
                    src.read(name, std::span<float>(ours, n), p.shape);
                    // Padded vocabulary rows are never looked up; they stay exactly zero.
                    std::fill(ours + n, ours + t->numel, 0.0f);
                } else {
                    staging.resize(n);
                    src.read(name, staging, p.shape);
                    scatter_transposed(ours, *t, p, staging.data());
                }
            }
        } catch (...) {
            store.release(u);
            throw;
        }
        store.release(u);
    }
}

std::string hf_config_json(const ModelConfig& cfg) {
    if (cfg.is_llama())
        return fmt::format(R"({{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": {},
  "hidden_size": {},
  "intermediate_size": {},
  "num_hidden_layers": {},
  "num_attention_heads": {},
  "num_key_value_heads": {},
  "head_dim": {},
  "hidden_act": "silu",
  "max_position_embeddings": {},
  "rms_norm_eps": {},
  "rope_theta": {},
  "rope_scaling": null,
  "attention_bias": false,
  "attention_dropout": 0.0,
  "mlp_bias": false,
  "pretraining_tp": 1,
  "initializer_range": {},
  "tie_word_embeddings": {},
  "use_cache": true,
  "torch_dtype": "float32"
}}
)",
                           cfg.vocab_size, cfg.n_embd, cfg.mlp_hidden(), cfg.n_layer, cfg.n_head,
                           cfg.kv_heads(), cfg.head_dim(), cfg.block_size, cfg.norm_eps,
                           cfg.rope_theta, cfg.init_std, cfg.tied_embeddings);
    // Between GPT-2 and Llama there is no Hugging Face architecture with these tensor names, so
    // such a model gets a model_type of its own that records every architecture choice.
    if (!cfg.is_gpt2())
        return fmt::format(R"({{
  "architectures": ["MemtrainLlamaStyle"],
  "model_type": "memtrain-llama-style",
  "vocab_size": {},
  "n_positions": {},
  "n_embd": {},
  "n_layer": {},
  "n_head": {},
  "n_kv_head": {},
  "ffn_hidden": {},
  "norm": "{}",
  "norm_eps": {},
  "activation": "{}",
  "positions": "{}",
  "rope_theta": {},
  "bias": {},
  "initializer_range": {},
  "tie_word_embeddings": {},
  "torch_dtype": "float32"
}}
)",
                           cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.n_layer, cfg.n_head,
                           cfg.kv_heads(), cfg.mlp_hidden(), cfg.norm, cfg.norm_eps, cfg.activation,
                           cfg.positions, cfg.rope_theta, cfg.bias, cfg.init_std,
                           cfg.tied_embeddings);
    return fmt::format(R"({{
  "architectures": ["GPT2LMHeadModel"],
  "model_type": "gpt2",
  "vocab_size": {},
  "n_positions": {},
  "n_ctx": {},
  "n_embd": {},
  "n_layer": {},
  "n_head": {},
  "activation_function": "gelu_new",
  "layer_norm_epsilon": {},
  "initializer_range": {},
  "resid_pdrop": 0.0,
  "embd_pdrop": 0.0,
  "attn_pdrop": 0.0,
  "tie_word_embeddings": true,
  "torch_dtype": "float32"
}}
)",
                       cfg.vocab_size, cfg.block_size, cfg.block_size, cfg.n_embd, cfg.n_layer,
                       cfg.n_head, cfg.norm_eps, cfg.init_std);
}

namespace {

// Typed reads of a config.json, each error naming the file and the key.
struct ConfigReader {
    const json& j;
    const std::string& path;
    bool has(const char* key) const { return j.contains(key) && !j[key].is_null(); }
    int integer(const char* key) const {
        if (!has(key)) fail("{}: config.json has no \"{}\"", path, key);
        const json& v = j[key];
        if (!v.is_number_integer() || v.get<int64_t>() <= 0 || v.get<int64_t>() > INT32_MAX)
            fail("{}: \"{}\" must be a positive integer, it is {}", path, key, v.dump());
        return v.get<int>();
    }
    int integer(const char* key, int fallback) const { return has(key) ? integer(key) : fallback; }
    double number(const char* key, double fallback) const {
        if (!has(key)) return fallback;
        const json& v = j[key];
        if (!v.is_number() || !(v.get<double>() > 0))
            fail("{}: \"{}\" must be a positive number, it is {}", path, key, v.dump());
        return v.get<double>();
    }
    bool boolean(const char* key, bool fallback) const {
        if (!has(key)) return fallback;
        if (!j[key].is_boolean()) fail("{}: \"{}\" must be true or false", path, key);
        return j[key].get<bool>();
    }
    std::string string(const char* key, const std::string& fallback) const {
        if (!has(key)) return fallback;
        if (!j[key].is_string()) fail("{}: \"{}\" must be a string", path, key);
        return j[key].get<std::string>();
    }
};

}  // namespace

ModelConfig model_config_from_hf(const std::string& path) {
    const json j = parse_json_file(path);
    if (!j.is_object()) fail("{}: expected a JSON object", path);
    const ConfigReader r{j, path};
    const std::string type = r.string("model_type", "");
    for (const char* moe : {"num_local_experts", "num_experts", "n_routed_experts",
                            "num_experts_per_tok", "moe_intermediate_size"})
        if (r.has(moe))
            fail(
                "{}: model_type \"{}\" is a mixture of experts (\"{}\"); memtrain trains dense "
                "GPT-2 and Llama models",
                path, type, moe);
    ModelConfig m;
    if (type == "gpt2") {
        m.n_embd = r.integer("n_embd");
        m.n_layer = r.integer("n_layer");
        m.n_head = r.integer("n_head");
        m.vocab_size = r.integer("vocab_size");
        m.block_size = r.integer("n_positions", 1024);
        m.norm_eps = r.number("layer_norm_epsilon", 1e-5);
        m.ffn_hidden = r.integer("n_inner", 0);
        m.tied_embeddings = r.boolean("tie_word_embeddings", true);
        const std::string act = r.string("activation_function", "gelu_new");
        if (act != "gelu_new" && act != "gelu_pytorch_tanh")
            fail(
                "{}: activation_function \"{}\" is not supported (memtrain's GPT-2 uses the tanh "
                "GELU: gelu_new or gelu_pytorch_tanh)",
                path, act);
        if (r.boolean("scale_attn_by_inverse_layer_idx", false))
            fail("{}: scale_attn_by_inverse_layer_idx = true is not supported", path);
    } else if (type == "llama") {
        m.norm = "rmsnorm";
        m.activation = "swiglu";
        m.positions = "rope";
        m.bias = false;
        m.n_embd = r.integer("hidden_size");
        m.n_layer = r.integer("num_hidden_layers");
        m.n_head = r.integer("num_attention_heads");
        m.n_kv_head = r.integer("num_key_value_heads", m.n_head);
        m.ffn_hidden = r.integer("intermediate_size");
        m.vocab_size = r.integer("vocab_size");
        m.block_size = r.integer("max_position_embeddings", 2048);
        m.norm_eps = r.number("rms_norm_eps", 1e-6);
        m.rope_theta = r.number("rope_theta", 10000.0);
        m.tied_embeddings = r.boolean("tie_word_embeddings", false);
        m.init_std = r.number("initializer_range", 0.02);
        if (r.has("head_dim") && (int64_t)r.integer("head_dim") * m.n_head != m.n_embd)
            fail("{}: head_dim = {} with {} heads is not hidden_size = {} (not supported)", path,
                 r.integer("head_dim"), m.n_head, m.n_embd);
        if (const std::string act = r.string("hidden_act", "silu"); act != "silu")
            fail("{}: hidden_act \"{}\" is not supported (Llama's SwiGLU uses silu)", path, act);
        if (r.has("rope_scaling"))
            fail(
                "{}: rope_scaling {} is not supported yet (memtrain applies plain RoPE with "
                "rope_theta)",
                path, j["rope_scaling"].dump());
        if (r.boolean("attention_bias", false) || r.boolean("mlp_bias", false))
            fail("{}: attention_bias / mlp_bias = true is not supported (Llama has no biases)",
                 path);
    } else if (type == "memtrain-llama-style") {
        m.n_embd = r.integer("n_embd");
        m.n_layer = r.integer("n_layer");
        m.n_head = r.integer("n_head");
        m.n_kv_head = r.integer("n_kv_head", m.n_head);
        m.ffn_hidden = r.integer("ffn_hidden", 0);
        m.vocab_size = r.integer("vocab_size");
        m.block_size = r.integer("n_positions");
        m.norm = r.string("norm", m.norm);
        m.norm_eps = r.number("norm_eps", m.norm_eps);
        m.activation = r.string("activation", m.activation);
        m.positions = r.string("positions", m.positions);
        m.rope_theta = r.number("rope_theta", m.rope_theta);
        m.bias = r.boolean("bias", true);
        m.tied_embeddings = r.boolean("tie_word_embeddings", true);
        m.init_std = r.number("initializer_range", m.init_std);
    } else {
        fail(
            "{}: model_type \"{}\" is not supported (memtrain reads \"gpt2\", \"llama\" and its "
            "own \"memtrain-llama-style\")",
            path, type);
    }
    try {
        m.validate();
    } catch (const Error& e) {
        fail("{}: {}", path, e.what());
    }
    return m;
}

std::string hf_config_json(const ModelConfig& cfg, const std::string& tokenizer) {
    if (tokenizer.empty()) return hf_config_json(cfg);
    return hf_config_json(cfg, data::Tokenizer::load(tokenizer));
}

std::string hf_config_json(const ModelConfig& cfg, const data::Tokenizer& tok) {
    std::string json = hf_config_json(cfg);
    const std::optional<uint32_t> eos = tok.eot_token();
    const std::optional<uint32_t> bos = tok.bos_token() ? tok.bos_token() : eos;
    std::string ids;
    if (bos) ids += fmt::format("  \"bos_token_id\": {},\n", *bos);
    if (eos) ids += fmt::format("  \"eos_token_id\": {},\n", *eos);
    json.insert(json.find("  \"torch_dtype\""), ids);
    return json;
}

}  // namespace memtrain
