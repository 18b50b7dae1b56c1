// Resolution of a model directory (see model_source.h).
#include "io/model_source.h"

#include <filesystem>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/hf_weights.h"
#include "io/lora_files.h"

namespace fs = std::filesystem;

namespace memtrain {

ModelSource open_model_source(const std::string& path) {
    fs::path p(path);
    if (!fs::exists(p)) fail("model {} does not exist", path);
    if (!fs::is_directory(p))
        fail(
            "model {} is a file; give a directory: a memtrain checkpoint, an out_dir with "
            "`latest`, or a Hugging Face model directory (config.json + safetensors)",
            path);
    ModelSource src;
    if (fs::exists(p / "memtrain.toml") || fs::exists(p / "latest")) {
        src.dir = resolve_checkpoint_dir(path);
        src.run = checkpoint_config(src.dir);
        src.model = src.run->model;
        src.weights = (fs::path(src.dir) / "model.safetensors").string();
        src.lora = has_lora_adapters(src.dir) && !fs::exists(src.weights);
        if (src.lora) src.weights = (fs::path(src.dir) / "adapter_model.safetensors").string();
    } else if (fs::exists(p / "config.json")) {
        src.dir = p.string();
        src.model = model_config_from_hf((p / "config.json").string());
        src.weights = p.string();  // model.safetensors or model.safetensors.index.json in it
    } else {
        fail(
            "{} is not a model directory: it has no memtrain.toml (a memtrain checkpoint), no "
            "`latest` (a training out_dir) and no config.json (a Hugging Face model)",
            path);
    }
    const fs::path d(src.dir);
    if (fs::exists(d / "tokenizer.json"))
        src.tokenizer = (d / "tokenizer.json").string();
    else if (fs::exists(d / "encoder.json") && fs::exists(d / "vocab.bpe"))
        src.tokenizer = d.string();
    return src;
}

void load_source_weights(const ModelSource& src, const ModelWeights& weights, bool refuse_unused) {
    if (src.lora)
        load_merged_lora_model(src.dir, *src.run, weights);
    else
        load_hf_weights(weights, src.weights, refuse_unused);
}

void load_init_weights(const ModelWeights& weights, const std::string& path, bool partial) {
    if (fs::is_directory(path))
        load_source_weights(open_model_source(path), weights, !partial);
    else  // a .safetensors file or an index (or a missing path, which it names)
        load_hf_weights(weights, path, !partial);
}

ModelConfig init_source_model(const ModelConfig& cfg) {
    if (!fs::is_directory(cfg.init_from))
        fail(
            "model.init_from = {} is not a model directory, and the config gives no [model] to "
            "describe its weights: give a directory (a Hugging Face model with config.json, a "
            "memtrain checkpoint or out_dir) or the model's keys",
            cfg.init_from);
    ModelConfig m = open_model_source(cfg.init_from).model;
    m.init_from = cfg.init_from;
    m.init_partial = cfg.init_partial;
    m.dropout = cfg.dropout;
    return m;
}

}  // namespace memtrain
