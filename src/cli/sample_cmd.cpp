// `memtrain sample MODEL --prompt "..." [--temperature --top-k --max-tokens --seed]`
// MODEL is a memtrain checkpoint, an out_dir with `latest`, or a Hugging Face model directory.
#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"
#include "data/tokenizer.h"
#include "io/hf_weights.h"
#include "io/model_source.h"
#include "train/sample.h"

namespace memtrain::cli {

void register_sample(CLI::App& app) {
    auto* cmd = app.add_subcommand("sample", "generate text from a checkpoint or a HF model dir");
    struct Args {
        std::string model, prompt, tokenizer;
        double temperature = 0.8;
        int top_k = 40;
        int max_tokens = 128;
        uint64_t seed = 1;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("model", a->model,
                    "checkpoint dir, out_dir with `latest`, or Hugging Face model directory")
        ->required();
    cmd->add_option("--prompt", a->prompt, "text to continue (default: start of a document)");
    cmd->add_option("--temperature", a->temperature,
                    "softmax temperature (> 0), or 0 for greedy decoding");
    cmd->add_option("--top-k", a->top_k, "sample among the k most likely tokens (0 = all)");
    cmd->add_option("--max-tokens", a->max_tokens, "tokens to generate");
    cmd->add_option("--seed", a->seed, "sampling seed");
    cmd->add_option("--tokenizer", a->tokenizer,
                    "tokenizer (default: the model directory's tokenizer files)");
    cmd->callback([a]() {
        if (!(a->temperature >= 0))
            fail("--temperature must be >= 0 (0 = greedy), got {}", a->temperature);
        if (a->top_k < 0) fail("--top-k must be >= 0, got {}", a->top_k);
        if (a->max_tokens < 0) fail("--max-tokens must be >= 0, got {}", a->max_tokens);
        const ModelSource src = open_model_source(a->model);
        GPT model(src.model);
        load_source_weights(src, model.weights());
        const std::string tok_path = a->tokenizer.empty() ? src.tokenizer : a->tokenizer;
        if (tok_path.empty())
            fail("{} has no tokenizer.json (nor encoder.json + vocab.bpe); pass --tokenizer",
                 src.dir);
        auto tok = data::Tokenizer::load(tok_path);
        if (tok.vocab_size() > src.model.vocab_size)
            fail("tokenizer {} has {} tokens but the model's vocab_size is {}", tok_path,
                 tok.vocab_size(), src.model.vocab_size);
        const std::vector<int32_t> prompt = prompt_tokens(tok, a->prompt);
        auto eot = tok.eot_token();
        Rng rng(a->seed);
        SampleOptions so{a->max_tokens, a->temperature, a->top_k, eot ? (int64_t)*eot : -1};
        auto out = generate(model, prompt, so, rng);
        const bool stopped = !out.empty() && (int64_t)out.back() == so.stop_token;
        if (stopped) out.pop_back();
        std::vector<uint32_t> ids(out.begin(), out.end());
        std::printf("%s%s\n", a->prompt.c_str(), tok.decode(ids).c_str());
        std::fflush(stdout);
        // Fewer tokens than asked for: say why, apart from the text (stderr).
        if (stopped)
            std::fprintf(
                stderr,
                "memtrain: the model ended the text (end-of-text token) after %zu of "
                "--max-tokens %d tokens%s\n",
                out.size(), a->max_tokens,
                a->temperature == 0 ? " (greedy: every run of this prompt stops there)" : "");
    });
}

}  // namespace memtrain::cli
