// `memtrain eval MODEL --data SHARD [--seq-len T] [--batch B] [--max-batches N] [--json]`:
// held-out loss and perplexity of a memtrain checkpoint or a Hugging Face model directory.
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/error.h"
#include "core/progress.h"
#include "data/loader.h"
#include "io/hf_weights.h"
#include "io/model_source.h"
#include "model/gpt.h"

namespace memtrain::cli {

void register_eval(CLI::App& app) {
    auto* cmd = app.add_subcommand("eval", "held-out loss and perplexity of a model on a shard");
    struct Args {
        std::string model, data;
        int seq_len = 0, batch = 4;
        int64_t max_batches = 0;
        bool json = false;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("model", a->model,
                    "checkpoint dir, out_dir with `latest`, or Hugging Face model directory")
        ->required();
    cmd->add_option("--data", a->data, "token shard (.bin from `memtrain tokenize`)")->required();
    cmd->add_option("--seq-len", a->seq_len,
                    "tokens per window (default: the run's train.seq_len, else "
                    "min(block_size, 1024))");
    cmd->add_option("--batch", a->batch, "windows per forward pass");
    cmd->add_option("--max-batches", a->max_batches, "stop after this many batches (0 = all)");
    cmd->add_flag("--json", a->json, "print one JSON object instead of a line");
    cmd->callback([a]() {
        const ModelSource src = open_model_source(a->model);
        const ModelConfig& m = src.model;
        int T = a->seq_len;
        if (T == 0) T = src.run ? src.run->train.seq_len : std::min(m.block_size, 1024);
        if (T <= 0 || T > m.block_size)
            fail("--seq-len {} must be in [1, model.block_size = {}]", T, m.block_size);
        if (a->batch <= 0 || (int64_t)a->batch * T > INT32_MAX)
            fail("--batch {} must be in [1, {}] at --seq-len {}", a->batch, INT32_MAX / T, T);
        if (a->max_batches < 0) fail("--max-batches must be >= 0, got {}", a->max_batches);
        int batch = a->batch;
        auto loader = std::make_unique<data::DataLoader>(a->data, batch, T, 0, false);
        if (loader->shard().vocab_size() > (uint32_t)m.vocab_size)
            fail("{} was tokenized with a vocabulary of {} tokens; the model has {}", a->data,
                 loader->shard().vocab_size(), m.vocab_size);
        if (loader->num_windows() == 0)
            fail("{} holds no window of --seq-len {} + 1 = {} tokens", a->data, T, T + 1);
        if (loader->num_windows() < (std::size_t)batch) {
            // A small shard (a few documents of validation): one partial batch of all of it.
            batch = (int)loader->num_windows();
            loader = std::make_unique<data::DataLoader>(a->data, batch, T, 0, false);
        }
        int64_t batches = (int64_t)(loader->num_windows() / batch);
        if (a->max_batches > 0) batches = std::min(batches, a->max_batches);
        GPT model(m);
        load_source_weights(src, model.weights());
        std::vector<int32_t> x((std::size_t)batch * T), y(x.size());
        double total = 0;
        // Progress on stderr; with --json only to a terminal, so a script that merges the
        // streams still reads one JSON object.
        Progress progress("eval", "batch", a->json && !isatty(STDERR_FILENO) ? 0 : batches);
        for (int64_t i = 0; i < batches; i++) {
            loader->next_batch(x.data(), y.data());
            total += model.forward_loss(x.data(), y.data(), batch, T);
            progress.tick(i + 1);
        }
        const double loss = total / (double)batches;
        const int64_t tokens = batches * batch * T;
        if (a->json)
            std::printf("%s\n",
                        fmt::format("{{\"model\": \"{}\", \"data\": \"{}\", \"tokens\": {}, "
                                    "\"seq_len\": {}, \"loss\": {:.6f}, \"perplexity\": {:.4f}}}",
                                    src.dir, a->data, tokens, T, loss, std::exp(loss))
                            .c_str());
        else
            std::printf("%s\n", fmt::format("eval {} on {}: {} tokens ({} windows of {}) | loss "
                                            "{:.4f} | perplexity {:.2f}",
                                            src.dir, a->data, tokens, batches * batch, T, loss,
                                            std::exp(loss))
                                    .c_str());
    });
}

}  // namespace memtrain::cli
