// `memtrain quantize MODEL --method M --bits B --out DIR`: post-training quantization of every
// block linear weight. DIR is a model directory that eval and sample read (dequantized fp32
// weights), plus quantized.safetensors (the packed form whose bytes the bpw figures count) and
// quantization.json (per-tensor and total bits, Kashin iterations and fallbacks).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "io/hf_weights.h"
#include "io/model_source.h"
#include "io/out_dir.h"
#include "io/safetensors.h"
#include "io/text_file.h"
#include "quant/quant.h"

namespace fs = std::filesystem;

namespace memtrain::cli {

namespace {

// The paper quantizes every 2-D weight of the blocks; embeddings, lm_head, norms and biases stay
// fp32. Llama's separate q/k/v and gate/up pieces map onto the same memtrain tensors.
bool is_block_linear(const HfPiece& p) {
    if (p.shape.size() != 2) return false;
    for (const char* s :
         {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"})
        if (p.ours.size() >= std::strlen(s) &&
            p.ours.compare(p.ours.size() - std::strlen(s), std::string::npos, s) == 0)
            return true;
    return false;
}

// (rows, cols) as the quantizers see it: one row per output channel. A GPT-2 Conv1D weight is
// stored (in, out) and is transposed; a Llama (nn.Linear) piece is already (out, in).
std::pair<int64_t, int64_t> out_in(const HfPiece& p) {
    return p.transposed ? std::pair{p.shape[0], p.shape[1]} : std::pair{p.shape[1], p.shape[0]};
}

std::vector<float> transpose(const std::vector<float>& a, int64_t rows, int64_t cols) {
    std::vector<float> t(a.size());
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++)
            t[(std::size_t)(j * rows + i)] = a[(std::size_t)(i * cols + j)];
    return t;
}

// A model whose weights are not finite quantizes to codes that mean nothing (NaN scales become
// zeros, reported as zero error): refused, naming the first such tensor.
void check_finite(const std::vector<float>& w, const std::string& name, const std::string& src) {
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < w.size(); i++)
        if (!std::isfinite(w[i]) && bad++ == 0) first = i;
    if (bad)
        fail(
            "{}: tensor {} holds {} non-finite values of {} (the first at index {}); refusing to "
            "quantize a model whose weights are not finite",
            src, name, bad, w.size(), first);
}

}  // namespace

void register_quantize(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "quantize", "post-training weight quantization (RTN, NF4, uniform, k-means, Kashin)");
    struct Args {
        std::string model, out;
        quant::Options o;
        bool json = false;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("model", a->model,
                    "checkpoint dir, out_dir with `latest`, or Hugging Face model directory")
        ->required();
    cmd->add_option("--method", a->o.method,
                    "rtn | rtn-asym | nf4 | nf4-dq | uniform | kmeans | kashin | kashin-dct")
        ->required();
    cmd->add_option("--bits", a->o.bits, "bits per weight code (nf4: 4)");
    cmd->add_option("--group", a->o.group,
                    "rtn, rtn-asym: inputs per scale (0 = one per output channel); nf4: block "
                    "(default 64)");
    cmd->add_option("--seed", a->o.seed,
                    "kashin: seed of the orthogonal Q1, Q2; kashin-dct: of the DCT sign flips");
    cmd->add_option("--max-iter", a->o.max_iter, "kashin: greedy steps before giving up");
    cmd->add_option("--tol", a->o.tol, "kashin: residual ||X - U - Q1 V Q2^T||_F to reach");
    cmd->add_flag("--kashin-force", a->o.kashin_force,
                  "kashin: quantize tensors whose decomposition did not converge anyway");
    cmd->add_option("--fallback", a->o.fallback,
                    "kashin: method (same --bits, one scale per row) for tensors that did not "
                    "converge");
    cmd->add_option("--out", a->out, "output model directory")->required();
    cmd->add_flag("--json", a->json, "print quantization.json instead of the table");
    cmd->callback([a]() {
        const quant::Options& o = a->o;
        const ModelSource src = open_model_source(a->model);
        if (src.lora)
            fail(
                "{} is a LoRA checkpoint (adapters only): merge it first with `memtrain lora "
                "merge {} --out DIR`, then quantize DIR",
                src.dir, a->model);
        const ModelConfig& cfg = src.model;
        const auto pieces = hf_pieces(cfg, hf_naming(cfg));
        for (const auto& p : pieces)
            if (is_block_linear(p)) {
                const auto [rows, cols] = out_in(p);
                try {
                    quant::check_options(o, rows, cols);
                } catch (const Error& e) {
                    fail("{} ({}): {}", p.name, io::shape_string(p.shape), e.what());
                }
            }
        // Written under a fresh name beside --out and swapped in whole (io/out_dir.h).
        io::StagedDir staged(a->out, "quantization.json", "memtrain quantize");
        const HfTensorSource source = HfTensorSource::open(src.weights);
        const fs::path tmp = staged.dir();
        {
            io::SafetensorsWriter model_w, quant_w;
            model_w.set_metadata("format", "pt");
            quant_w.set_metadata("format", "memtrain-quantized");
            quant_w.set_metadata("method", o.method);
            std::deque<std::vector<float>> keep;
            std::deque<quant::Result> results;
            nlohmann::json tensors = nlohmann::json::array();
            int64_t q_weights = 0, all_params = 0;
            uint64_t q_bits = 0, all_bits = 0;
            int fallbacks = 0;
            std::vector<std::string> fell_back;
            std::string table;
            for (const auto& p : pieces) {
                int64_t numel = 1;
                for (int64_t d : p.shape) numel *= d;
                std::vector<float> w((std::size_t)numel);
                source.read(p.name, w, p.shape);
                check_finite(w, p.name, src.dir);
                all_params += numel;
                if (!is_block_linear(p)) {
                    all_bits += 32 * (uint64_t)numel;
                    keep.push_back(std::move(w));
                    model_w.add(p.name, io::DType::F32, p.shape, keep.back().data());
                    continue;
                }
                const auto [rows, cols] = out_in(p);
                const std::vector<float> mat = p.transposed ? w : transpose(w, cols, rows);
                const auto t0 = std::chrono::steady_clock::now();
                results.push_back(quant::quantize(o, {mat.data(), rows, cols}));
                const double secs =
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                const quant::Result& r = results.back();
                double err = 0, ref = 0;
                for (std::size_t i = 0; i < mat.size(); i++) {
                    err += ((double)mat[i] - r.dequant[i]) * ((double)mat[i] - r.dequant[i]);
                    ref += (double)mat[i] * mat[i];
                }
                const double rel = ref > 0 ? std::sqrt(err / ref) : 0.0;
                keep.push_back(p.transposed ? r.dequant : transpose(r.dequant, rows, cols));
                model_w.add(p.name, io::DType::F32, p.shape, keep.back().data());
                nlohmann::json parts = nlohmann::json::object();
                for (const auto& part : r.parts) {
                    quant_w.add(p.name + "." + part.name, part.dtype, part.shape,
                                part.bytes.data());
                    parts[part.name] = {{"dtype", io::dtype_name(part.dtype)},
                                        {"shape", part.shape},
                                        {"bytes", part.bytes.size()}};
                }
                q_weights += numel;
                q_bits += r.stored_bits();
                all_bits += r.stored_bits();
                if (r.fell_back) fallbacks++, fell_back.push_back(p.name);
                nlohmann::json t = {{"name", p.name},
                                    {"shape", p.shape},
                                    {"stored_as", p.transposed ? "(out, in)" : "(in, out)"},
                                    {"method", r.method},
                                    {"bits", r.bits},
                                    {"group", r.group},
                                    {"stored_bits", r.stored_bits()},
                                    {"bpw", r.bpw()},
                                    {"rel_error", rel},
                                    {"seconds", secs},
                                    {"parts", parts}};
                if (o.method.rfind("kashin", 0) == 0) {
                    t["iterations"] = r.iterations;
                    t["converged"] = r.converged;
                    t["residual"] = r.residual;
                    t["fallback"] = r.fell_back;
                }
                tensors.push_back(t);
                table += fmt::format(
                    "{:<34} {:>11} {:<8} {:>4} {:>8.4f} {:>9.5f} {:>5} {:>9} {:>7.2f}\n", p.name,
                    fmt::format("{}x{}", rows, cols), r.method, r.bits, r.bpw(), rel,
                    o.method.rfind("kashin", 0) == 0 ? std::to_string(r.iterations) : "-",
                    o.method != "kashin" ? "-"
                    : r.fell_back        ? "fallback"
                    : r.converged        ? "yes"
                                         : "forced",
                    secs);
            }
            nlohmann::json j = {
                {"source", src.dir},
                {"method", o.method},
                {"bits", o.bits},
                {"group", o.group},
                {"layout",
                 "rows are output channels; groups and blocks run along the inputs of a row"},
                {"tensors", tensors},
                {"totals",
                 {{"quantized_tensors", tensors.size()},
                  {"quantized_weights", q_weights},
                  {"quantized_stored_bits", q_bits},
                  {"bpw_quantized", q_weights ? (double)q_bits / (double)q_weights : 0.0},
                  {"model_params", all_params},
                  {"model_stored_bits", all_bits},
                  {"bpw_model", (double)all_bits / (double)all_params}}}};
            if (o.method == "kashin") {
                j["seed"] = o.seed;
                j["max_iter"] = o.max_iter;
                j["tol"] = o.tol;
                j["kashin_force"] = o.kashin_force;
                j["fallback_method"] = o.fallback;
                j["totals"]["fallbacks"] = fallbacks;
                j["totals"]["fallback_tensors"] = fell_back;
            }
            model_w.write((tmp / "model.safetensors").string());
            quant_w.write((tmp / "quantized.safetensors").string());
            io::write_text_file(tmp / "quantization.json", j.dump(2) + "\n");
            io::write_text_file(tmp / "config.json", hf_config_json(cfg, src.tokenizer));
            if (!src.tokenizer.empty()) {
                if (fs::is_directory(src.tokenizer)) {
                    for (const char* f : {"encoder.json", "vocab.bpe"})
                        io::write_text_file(
                            tmp / f, read_regular_file((fs::path(src.tokenizer) / f).string(),
                                                       kMaxTokenizerBytes, f));
                } else {
                    io::write_text_file(
                        tmp / "tokenizer.json",
                        read_regular_file(src.tokenizer, kMaxTokenizerBytes, "tokenizer.json"));
                }
            }
            staged.commit();
            if (a->json) {
                std::printf("%s\n", j.dump(2).c_str());
                return;
            }
            std::printf(
                "%s", fmt::format("{:<34} {:>11} {:<8} {:>4} {:>8} {:>9} {:>5} {:>9} {:>7}\n",
                                  "tensor", "out x in", "method", "bits", "bpw", "rel.err", "iters",
                                  "converged", "seconds")
                          .c_str());
            std::printf("%s", table.c_str());
            std::printf("%s\n",
                        fmt::format("quantized {} tensors ({} weights) with {} {}-bit: {:.4f} bpw "
                                    "over quantized tensors, {:.4f} over the whole model{}; "
                                    "wrote {}",
                                    tensors.size(), q_weights, o.method, o.bits,
                                    j["totals"]["bpw_quantized"].get<double>(),
                                    j["totals"]["bpw_model"].get<double>(),
                                    o.method == "kashin"
                                        ? fmt::format("; {} of {} fell back to {}", fallbacks,
                                                      tensors.size(), o.fallback)
                                        : "",
                                    staged.out())
                            .c_str());
        }
    });
}

}  // namespace memtrain::cli
