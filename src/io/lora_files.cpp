// PEFT adapter files (see lora_files.h).
#include "io/lora_files.h"

#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/hf_weights.h"
#include "io/model_source.h"
#include "io/safetensors.h"
#include "io/text_file.h"
#include "quant/quantized_store.h"

namespace fs = std::filesystem;

namespace memtrain {

namespace {

std::string adapter_file(const std::string& path) {
    return fs::is_directory(path) ? (fs::path(path) / "adapter_model.safetensors").string() : path;
}

}  // namespace

std::string peft_tensor_name(const ModelConfig& cfg, const std::string& tensor) {
    // GPT2LMHeadModel keeps its blocks under "transformer."; LlamaForCausalLM's are already
    // "model.layers.N" (the module path the layout uses).
    return "base_model.model." + std::string(cfg.is_llama() ? "" : "transformer.") + tensor;
}

std::string adapter_config_json(const RunConfig& cfg, const LoraLayout& layout) {
    nlohmann::ordered_json j;
    j["peft_type"] = "LORA";
    j["task_type"] = "CAUSAL_LM";
    j["base_model_name_or_path"] = cfg.model.init_from;
    j["r"] = cfg.lora.rank;
    j["lora_alpha"] = cfg.lora.alpha;
    j["lora_dropout"] = cfg.lora.dropout;
    j["target_modules"] = layout.names;
    j["bias"] = "none";
    // GPT-2's Conv1D stores (in, out), which PEFT must know to merge.
    j["fan_in_fan_out"] = !cfg.model.is_llama();
    j["init_lora_weights"] = "gaussian";
    j["inference_mode"] = true;
    j["use_rslora"] = false;
    j["modules_to_save"] = nullptr;
    return j.dump(2) + "\n";
}

void save_lora_adapters(const std::string& dir, const RunConfig& cfg, const LoraLayout& layout,
                        WeightWindow& store, bool write) {
    const ParamLayout& pl = layout.params;
    // The adapters are small (r (in + out) per site): gather them whole, unit by unit as every
    // rank does, then write.
    std::vector<float> all(pl.total);
    for (int u = 0; u < (int)pl.units.size(); u++) {
        const float* p = store.acquire(u);
        std::copy(p, p + pl.units[u].size(), all.begin() + (std::ptrdiff_t)pl.units[u].begin);
        store.release(u);
    }
    if (!write) return;
    io::SafetensorsWriter w;
    w.set_metadata("format", "pt");
    for (const ParamSpec& t : pl.tensors)
        w.add(peft_tensor_name(cfg.model, t.name), io::DType::F32, t.shape, all.data() + t.offset);
    w.write((fs::path(dir) / "adapter_model.safetensors").string());
    io::write_text_file(fs::path(dir) / "adapter_config.json", adapter_config_json(cfg, layout));
}

void load_lora_adapters(const std::string& path, const ModelConfig& cfg, const LoraLayout& layout,
                        WeightWindow& store) {
    const std::string file = adapter_file(path);
    if (!fs::exists(file)) fail("{}: no LoRA adapters (adapter_model.safetensors) there", path);
    const HfTensorSource src = HfTensorSource::open(file);
    const ParamLayout& pl = layout.params;
    for (int u = 0; u < (int)pl.units.size(); u++) {
        const ParamUnit& unit = pl.units[u];
        float* base = store.acquire(u, true);
        for (std::size_t i = unit.first_tensor; i < unit.last_tensor; i++) {
            const ParamSpec& t = pl.tensors[i];
            const std::string name = peft_tensor_name(cfg, t.name);
            if (!src.has(name))
                fail(
                    "{}: adapter tensor {} is missing (lora.rank and lora.targets must match the "
                    "run that wrote it)",
                    file, name);
            src.read(name, {base + (t.offset - unit.begin), t.numel}, t.shape);
        }
        store.release(u);
    }
}

bool has_lora_adapters(const std::string& dir) {
    return fs::exists(fs::path(dir) / "adapter_model.safetensors");
}

void load_merged_lora_model(const std::string& ckpt_dir, const RunConfig& cfg,
                            const ModelWeights& weights) {
    if (!cfg.lora.enabled())
        fail("{}: its memtrain.toml has lora.rank = 0, yet it holds adapters", ckpt_dir);
    if (!cfg.model.init_from.empty())
        load_init_weights(weights, cfg.model.init_from, cfg.model.init_partial);
    else
        init_gpt2_weights(weights, cfg.train.seed);
    // QLoRA trained against the quantized base: merge into what it decodes to.
    if (cfg.lora.base != "fp32") quant::round_trip_base(weights, quant::lora_base_quant(cfg.lora));
    const LoraLayout layout = make_lora_layout(cfg.model, cfg.lora);
    FullUnitStore adapters(layout.params);
    load_lora_adapters(ckpt_dir, cfg.model, layout, adapters);
    float* base = weights.store.full_params();
    if (!base) fail("internal: load_merged_lora_model needs a whole model");
    merge_lora(base, weights.layout, adapters.full_params(), layout, cfg.lora.scale());
}

}  // namespace memtrain
