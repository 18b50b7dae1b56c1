// Helpers shared by tests: temporary directories, tiny token shards and tiny run configs, random
// inputs, the PyTorch parity fixture's sizes and the messages of thrown Errors.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "core/allocator.h"
#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"
#include "data/shard.h"
#include "io/safetensors.h"
#include "model/gpt.h"
#include "train/trainer.h"

namespace memtrain::test {

// One category's bytes of a per-category array (MemoryStats' used, peak_used, reserved).
inline std::size_t category_bytes(const std::array<std::size_t, kNumMemCategories>& a,
                                  MemCategory k) {
    return a[static_cast<int>(k)];
}

// The message of the Error `f` throws ("" if it throws none).
template <typename F>
std::string error_of(F&& f) {
    try {
        f();
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

// Whether the CUDA device is cudasim's (tests/cudasim): the CUDA tests' objects are linked both
// with the simulator and with the GPU backend, and a few checks differ between the two.
inline bool on_cudasim() {
    return cuda_available() && cuda_device_name().rfind("memtrain CUDA simulator", 0) == 0;
}

// Where tests write: MEMTRAIN_TEST_TMP, else test_tmp in the build tree (the GPU bundle's test
// binaries run away from the tree they were built in: bench/gpu_device.sh sets it).
inline std::filesystem::path test_tmp_root() {
    const char* v = std::getenv("MEMTRAIN_TEST_TMP");
    return v && *v ? std::filesystem::path(v) : std::filesystem::path(MT_BINARY_DIR) / "test_tmp";
}

// A fresh directory under test_tmp_root(), removed at construction if it existed.
inline std::string temp_dir(const std::string& name) {
    auto p = test_tmp_root() / name;
    std::filesystem::remove_all(p);
    std::filesystem::create_directories(p);
    return p.string();
}

// A tiny GPT-2: 2 heads x 16 wide, context 8, a vocabulary that is not a multiple of the padding.
inline ModelConfig tiny_model(int layers = 2) {
    ModelConfig c;
    c.n_layer = layers;
    c.n_head = 2;
    c.n_embd = 16;
    c.block_size = 8;
    c.vocab_size = 37;
    c.vocab_pad = 16;
    return c;
}

// A tiny Llama-style model: 4 heads of 4 over 2 kv heads, rmsnorm, swiglu with a small explicit
// MLP width, rope, an untied output embedding.
inline ModelConfig tiny_llama(int layers = 2) {
    ModelConfig c = tiny_model(layers);
    c.n_head = 4;
    c.n_kv_head = 2;
    c.norm = "rmsnorm";
    c.activation = "swiglu";
    c.positions = "rope";
    c.tied_embeddings = false;
    c.ffn_hidden = 24;
    c.norm_eps = 1e-6;
    c.rope_theta = 1000.0;
    return c;
}

// The GPT-2 that tests/parity/make_fixture.py writes (vocabulary, context, layers, heads, width)
// and its token batch: kFixtureBatch rows of kFixtureSeq + 1 tokens.
inline constexpr int kFixtureVocab = 96, kFixtureBlock = 32, kFixtureLayers = 2, kFixtureHeads = 4,
                     kFixtureEmbd = 64, kFixtureBatch = 2, kFixtureSeq = 16;

// The F32 tensor `name` of `f`, which must have `shape`.
inline std::vector<float> read_f32_tensor(const io::SafetensorsFile& f, const std::string& name,
                                          std::vector<int64_t> shape) {
    std::size_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> out(n);
    f.read_f32(f.get(name), out, name, shape);
    return out;
}

// `n` normal draws of standard deviation `sd`.
inline std::vector<float> gaussian(int64_t n, uint64_t seed, float sd = 1.0f) {
    Rng rng(seed);
    std::vector<float> v((std::size_t)n);
    for (auto& x : v) x = (float)(sd * rng.normal());
    return v;
}

// Uniformly random token ids.
inline std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
    Rng r(seed);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = (int32_t)(r.next_u64() % vocab);
    return t;
}

// Checks the model's analytic gradient (one forward_backward on x, y) against central finite
// differences of forward_loss, at about `per_tensor` coordinates of every tensor (padded
// vocabulary rows excluded). Returns how many coordinates were checked.
inline int check_model_gradient(GPT& m, const std::vector<int32_t>& x,
                                const std::vector<int32_t>& y, int B, int T, int per_tensor) {
    const ModelConfig& c = m.config();
    m.zero_grads();
    m.forward_backward(x.data(), y.data(), B, T, 1.0f / (B * T));
    std::vector<float> g(m.grads(), m.grads() + m.num_params());
    const float h = 1e-2f;
    int checked = 0;
    for (const auto& t : m.layout().tensors) {
        bool vocab_rows = t.name == "wte.weight" || t.name == "lm_head.weight";
        for (std::size_t k = 0; k < t.numel; k += std::max<std::size_t>(1, t.numel / per_tensor)) {
            if (vocab_rows && k >= (std::size_t)c.vocab_size * c.n_embd) continue;
            std::size_t i = t.offset + k;
            float s = m.params()[i];
            m.params()[i] = s + h;
            double lp = m.forward_loss(x.data(), y.data(), B, T);
            m.params()[i] = s - h;
            double lm = m.forward_loss(x.data(), y.data(), B, T);
            m.params()[i] = s;
            double num = (lp - lm) / (2 * h);
            EXPECT_NEAR(g[i], num, 2e-3 + 2e-2 * std::abs(num)) << t.name << "[" << k << "]";
            checked++;
        }
    }
    return checked;
}

// Options of a Trainer that prints nothing; `resume` a checkpoint (or out dir) to resume from,
// `stop_after` steps to stop after (checkpointing there), -1 to run to the end.
inline TrainOptions quiet(std::string resume = "", int stop_after = -1) {
    TrainOptions o;
    o.quiet = true;
    o.resume = std::move(resume);
    o.stop_after = stop_after;
    return o;
}

// Trains `cfg` for `first_steps` steps (checkpointing at the stop), then resumes from that
// checkpoint in a new Trainer and runs to cfg.train.max_steps. Returns the resumed trainer;
// `resumed` receives its summary.
inline std::unique_ptr<Trainer> train_stop_and_resume(const RunConfig& cfg, int first_steps,
                                                      TrainSummary& resumed) {
    TrainOptions o;
    o.quiet = true;
    o.stop_after = first_steps;
    Trainer(cfg, o).run();
    o.stop_after = -1;
    o.resume = cfg.io.out_dir;
    auto second = std::make_unique<Trainer>(cfg, o);
    resumed = second->run();
    return second;
}

// A token stream with structure a model can learn: a noisy repeating pattern.
inline std::vector<uint32_t> patterned_tokens(std::size_t n, uint32_t vocab, uint64_t seed) {
    Rng r(seed);
    std::vector<uint32_t> t(n);
    for (std::size_t i = 0; i < n; i++)
        t[i] =
            (r.uniform() < 0.1f) ? (uint32_t)(r.next_u64() % vocab) : (uint32_t)((i * 7) % vocab);
    return t;
}

// The tiny model and run of tiny_run, over shards in `dir` that tiny_run writes.
inline RunConfig tiny_run_config(const std::string& dir, int steps = 10) {
    RunConfig c;
    c.model.n_layer = 2;
    c.model.n_head = 2;
    c.model.n_embd = 16;
    c.model.block_size = 16;
    c.model.vocab_size = 50;
    c.model.vocab_pad = 16;
    c.train.seq_len = 8;
    c.train.batch_size = 4;
    c.train.micro_batch_size = 2;
    c.train.device = "cpu";  // the CPU reference, also where a GPU answers
    // fp32 on every machine: "auto" would multiply in bf16 where the CPU has bf16 instructions.
    c.train.precision = "fp32";
    c.train.max_steps = steps;
    c.train.eval_every = 5;
    c.train.eval_batches = 2;
    c.optim.lr = 3e-3;
    c.optim.warmup_steps = 2;
    c.data.train = dir + "/train.bin";
    c.data.val = dir + "/val.bin";
    c.io.out_dir = dir + "/out";
    c.sample.max_tokens = 0;
    return c;
}

// A tiny model and run over freshly written shards in `dir`.
inline RunConfig tiny_run(const std::string& dir, int steps = 10) {
    data::write_shard(dir + "/train.bin", patterned_tokens(4096, 50, 1), 50);
    data::write_shard(dir + "/val.bin", patterned_tokens(1024, 50, 2), 50);
    return tiny_run_config(dir, steps);
}

}  // namespace memtrain::test
