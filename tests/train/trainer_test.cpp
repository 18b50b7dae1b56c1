// Training-loop tests: learning happens, same seed gives the same bits, resume is exact, and
// checkpoints are complete and atomic.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "remat/cost.h"
#include "remat/policy.h"
#include "remat/solver.h"
#include "test_util.h"
#include "train/plan.h"
#include "train/trainer.h"
#include "train/validate.h"

using namespace memtrain;
namespace fs = std::filesystem;

namespace {

TrainOptions opts(std::string resume = "", int stop_after = -1) {
    TrainOptions o;
    o.resume = std::move(resume);
    o.quiet = true;
    o.stop_after = stop_after;
    return o;
}

}  // namespace

TEST(Trainer, LossDecreasesOnStructuredData) {
    auto dir = test::temp_dir("trainer_learns");
    RunConfig c = test::tiny_run(dir, 100);
    c.optim.lr = 1e-2;
    Trainer t(c, opts());
    auto s = t.run();
    ASSERT_EQ(s.losses.size(), 100u);
    EXPECT_LT(s.losses.back(), s.losses.front() - 1.0f);
    ASSERT_FALSE(s.val_losses.empty());
    EXPECT_TRUE(fs::exists(dir + "/out/metrics.jsonl"));
    EXPECT_TRUE(fs::exists(dir + "/out/ckpt_000100/model.safetensors"));
}

TEST(Trainer, SameSeedTwiceGivesSameBits) {
    auto d1 = test::temp_dir("trainer_seed1"), d2 = test::temp_dir("trainer_seed2");
    Trainer a(test::tiny_run(d1, 6), opts());
    Trainer b(test::tiny_run(d2, 6), opts());
    auto sa = a.run(), sb = b.run();
    EXPECT_EQ(sa.losses, sb.losses);
    EXPECT_EQ(0, std::memcmp(a.model().params(), b.model().params(), a.model().num_params() * 4));
}

TEST(Trainer, ResumeReproducesUninterruptedRunBitwise) {
    auto d1 = test::temp_dir("resume_full"), d2 = test::temp_dir("resume_split");
    RunConfig full = test::tiny_run(d1, 20);
    Trainer a(full, opts());
    auto sa = a.run();

    RunConfig split = test::tiny_run(d2, 20);
    {
        Trainer first(split, opts("", 10));
        auto s1 = first.run();
        ASSERT_EQ(s1.steps_done, 10);
        for (int i = 0; i < 10; i++) EXPECT_EQ(s1.losses[i], sa.losses[i]);
    }
    Trainer second(split, opts(split.io.out_dir));
    auto s2 = second.run();
    ASSERT_EQ(s2.losses.size(), 10u);
    for (int i = 0; i < 10; i++) EXPECT_EQ(s2.losses[i], sa.losses[10 + i]) << "step " << 11 + i;
    EXPECT_EQ(0,
              std::memcmp(a.model().params(), second.model().params(), a.model().num_params() * 4))
        << "parameters after 10 + resume + 10 steps differ from 20 uninterrupted steps";
}

// model.dropout end to end: a run resumes bitwise (the masks are keyed by the step, not by the
// process), a sequence draws the same mask at any micro-batch split (so accumulation and
// data-parallel ranks see the same masks), the checkpoint keeps the key, and it changes training.
TEST(Trainer, DropoutResumesBitwiseAndFollowsTheSequence) {
    auto d1 = test::temp_dir("dropout_full"), d2 = test::temp_dir("dropout_split"),
         d3 = test::temp_dir("dropout_micro"), d4 = test::temp_dir("dropout_none");
    RunConfig full = test::tiny_run(d1, 8);
    full.model.dropout = 0.1;
    Trainer a(full, opts());
    auto sa = a.run();

    RunConfig split = test::tiny_run(d2, 8);
    split.model.dropout = 0.1;
    TrainSummary s2;
    auto second = test::train_stop_and_resume(split, 4, s2);
    ASSERT_EQ(s2.losses.size(), 4u);
    for (int i = 0; i < 4; i++) EXPECT_EQ(s2.losses[i], sa.losses[4 + i]) << "step " << 5 + i;
    EXPECT_EQ(
        0, std::memcmp(a.model().params(), second->model().params(), a.model().num_params() * 4));
    EXPECT_EQ(load_run_config(d2 + "/out/ckpt_000004/memtrain.toml", {}).model.dropout, 0.1);

    RunConfig micro = test::tiny_run(d3, 8);
    micro.model.dropout = 0.1;
    micro.train.micro_batch_size = 1;  // 4 micro-batches of one sequence instead of 2 of two
    auto sm = Trainer(micro, opts()).run();
    for (int i = 0; i < 8; i++) EXPECT_NEAR(sm.losses[i], sa.losses[i], 1e-5) << "step " << i + 1;

    auto sn = Trainer(test::tiny_run(d4, 8), opts()).run();
    EXPECT_GT(std::abs(sn.losses[7] - sa.losses[7]), 1e-4) << "dropout changed nothing";
}

// train.cpu_attention = "lse": the run tracks the probabilities' run to rounding, with fewer
// activation bytes (the (B,NH,T,T) probabilities become (B,NH,T) log-sum-exps), measured =
// predicted; a value that is neither is refused by name.
TEST(Trainer, LogSumExpAttentionTracksTheProbabilitiesWithLessMemory) {
    auto d1 = test::temp_dir("cpu_attention_probs"), d2 = test::temp_dir("cpu_attention_lse");
    RunConfig probs = test::tiny_run(d1, 6), lse = test::tiny_run(d2, 6);
    lse.train.cpu_attention = "lse";
    const std::size_t before = host_memory().snapshot()[MemCategory::Activations];
    TrainSummary sa;
    std::size_t probs_peak = 0;
    {
        host_memory().reset_peak();
        Trainer a(probs, opts());
        sa = a.run();
        probs_peak = host_memory().snapshot().peak(MemCategory::Activations) - before;
    }
    host_memory().reset_peak();
    Trainer b(lse, opts());
    auto sb = b.run();
    ASSERT_EQ(sa.losses.size(), sb.losses.size());
    for (std::size_t i = 0; i < sa.losses.size(); i++)
        EXPECT_NEAR(sb.losses[i], sa.losses[i], 1e-4) << "step " << i + 1;
    std::size_t predicted = 0;
    for (const auto& row : b.engine().predicted_memory(lse.micro_batch(), lse.train.seq_len))
        if (row.category == MemCategory::Activations) predicted += row.bytes;
    EXPECT_EQ(b.engine().memory().snapshot().peak(MemCategory::Activations) - before, predicted);
    const std::size_t B = lse.micro_batch(), T = lse.train.seq_len, NH = lse.model.n_head;
    EXPECT_EQ(probs_peak - predicted, lse.model.n_layer * B * NH * T * (T - 1) * sizeof(float));
    RunConfig bad = test::tiny_run_config("/nonexistent", 4);
    bad.train.cpu_attention = "flash";
    EXPECT_NE(test::error_of([&] {
                  validate_config(bad);
              }).find("train.cpu_attention = \"flash\" must be \"probs\""),
              std::string::npos);
}

// train.remat = memory-poor, chen:K and revolve:S through the trainer: the losses and weights of
// keeping everything, bitwise, measured = predicted activations below full's, and refused by name
// where they are not built.
TEST(Trainer, MemoryPoorAndChenTrainBitwiseBelowFull) {
    std::vector<float> ref_params;
    std::vector<float> ref_losses;
    std::size_t full_bytes = 0;
    for (const char* policy : {"none", "full", "chen:3", "revolve:2", "memory-poor"}) {
        auto d = test::temp_dir(std::string("rebuild_") + std::string(policy).substr(0, 4));
        RunConfig c = test::tiny_run(d, 4);
        c.model.n_layer = 8;  // chen:3 keeps 3 inputs, rebuilds 5 and holds 2 (plus 2 temporaries)
        c.train.remat = policy;
        Trainer t(c, opts());
        auto s = t.run();
        std::size_t predicted = 0;
        for (const auto& row : t.engine().predicted_memory(c.micro_batch(), c.train.seq_len))
            if (row.category == MemCategory::Activations) predicted += row.bytes;
        const std::string what = policy;
        if (ref_losses.empty()) {
            ref_losses = s.losses;
            ref_params.assign(t.model().params(), t.model().params() + t.model().num_params());
            continue;
        }
        EXPECT_EQ(s.losses, ref_losses) << what;
        EXPECT_EQ(0, std::memcmp(t.model().params(), ref_params.data(), ref_params.size() * 4))
            << what;
        if (what == "full")
            full_bytes = predicted;
        else
            EXPECT_LT(predicted, full_bytes) << what;
    }
    // A budget below full's floor trains too (it solves to a plan that rebuilds inputs).
    {
        auto d = test::temp_dir("rebuild_budget");
        RunConfig c = test::tiny_run(d, 4);
        c.model.n_layer = 8;
        const std::size_t lo =
            remat::min_feasible_bytes(remat::make_chain(c.model, c.micro_batch(), c.train.seq_len));
        c.train.remat = fmt::format("budget:{}", lo - 1);
        Trainer t(c, opts());
        auto s = t.run();
        const RematPlan& plan = t.engine().remat_plan();
        EXPECT_TRUE(std::any_of(plan.begin(), plan.end(), rebuilds_input));
        EXPECT_EQ(s.losses, ref_losses);
        c.train.pp = 2;
        c.world = 2;
        EXPECT_NE(test::error_of([&] {
                      plan_layout(c, 0, 2, false, nullptr);
                  }).find("solves to a plan that rebuilds block inputs"),
                  std::string::npos);
    }
    RunConfig bad = test::tiny_run_config("/nonexistent", 4);
    bad.train.remat = "memory-poor";
    bad.world = 2;
    bad.train.pp = 2;  // a pipeline rebuilds within each stage, but not in a split backward
    bad.train.pp_schedule = "zb-h1";
    EXPECT_NE(
        test::error_of([&] {
            validate_config(bad);
        }).find("train.remat = memory-poor does not run with train.pp_schedule = \"zb-h1\" yet"),
        std::string::npos);
}

// Where model.dropout is not built yet, the config is refused by name.
TEST(Config, DropoutIsRefusedWhereItIsNotBuilt) {
    auto refused = [](auto&& edit, const std::string& key) {
        RunConfig c = test::tiny_run_config("/nonexistent", 4);
        c.model.dropout = 0.1;
        c.world = 4;
        edit(c);
        const std::string m = test::error_of([&] { validate_config(c); });
        EXPECT_NE(m.find("model.dropout = 0.1 does not run with " + key), std::string::npos) << m;
    };
    refused([](RunConfig& c) { c.train.tp = 2; }, "train.tp = 2");
    refused(
        [](RunConfig& c) {
            c.train.dp_mode = "ps";
            c.train.ps_servers = 1;
        },
        "train.dp_mode = \"ps\"");
    RunConfig bad = test::tiny_run_config("/nonexistent", 4);
    bad.model.dropout = 1.0;
    EXPECT_NE(
        test::error_of([&] { validate_config(bad); }).find("model.dropout = 1 must be in [0, 1)"),
        std::string::npos);
    bad.model.dropout = 0.1;
    bad.world = 2;
    validate_config(bad);  // DDP and ZeRO run it, and pipelines
    bad.train.pp = 2;
    validate_config(bad);
}

// train.mlp_tile from the trainer: the memory-poor floor with the MLP in tiles of 4 token rows
// trains as the untiled full-memory run does (to rounding: the weight gradients are summed tile
// by tile), below the untiled floor, its activations measured as predicted; what it does not
// run with is refused by name.
TEST(Trainer, TiledMlpTrainsBelowTheUntiledFloor) {
    for (const std::string saved : {"fp32", "bf16", "int8"}) {
        SCOPED_TRACE("train.cpu_activations = " + saved);
        std::vector<float> ref;
        std::size_t untiled = 0;
        for (int tile : {0, 4}) {
            auto d = test::temp_dir("tiled_mlp_" + saved + std::to_string(tile));
            RunConfig c = test::tiny_run(d, 4);
            c.model.n_layer = 4;
            c.train.precision = "fp32";
            c.train.cpu_activations = saved;
            // int8: a tile of 4 rows of ln_2's 64 values is one 256-value block.
            if (saved == "int8") c.model.n_embd = 64;
            c.train.remat = tile ? "memory-poor" : "none";
            c.train.mlp_tile = tile;
            Trainer t(c, opts());
            const auto s = t.run();
            std::size_t predicted = 0;
            for (const auto& row : t.engine().predicted_memory(c.micro_batch(), c.train.seq_len))
                if (row.category == MemCategory::Activations) predicted += row.bytes;
            EXPECT_EQ(t.engine().memory().snapshot()[MemCategory::Activations], predicted);
            if (tile == 0) {
                ref = s.losses;
                const RunConfig& rc = t.config();
                untiled = remat::solve_policy(remat::parse_policy("memory-poor"), rc.model,
                                              rc.micro_batch(), rc.train.seq_len, nullptr,
                                              cpu_arena_format(rc.model))
                              .peak_bytes;
                continue;
            }
            EXPECT_LT(predicted, untiled);
            ASSERT_EQ(s.losses.size(), ref.size());
            for (std::size_t i = 0; i < ref.size(); i++)
                // (Compressed fields: a tile's GEMM may round a value to the neighbouring step.)
                EXPECT_NEAR(s.losses[i], ref[i], (saved == "fp32" ? 1e-5 : 1e-3) * std::abs(ref[i]))
                    << "step " << i + 1;
        }
    }
    auto refused = [](auto&& edit, const std::string& key) {
        RunConfig c = test::tiny_run_config("/nonexistent", 4);
        c.train.mlp_tile = 64;
        c.train.precision = "fp32";
        edit(c);
        const std::string m = test::error_of([&] { validate_config(c); });
        EXPECT_NE(m.find(key), std::string::npos) << m;
    };
    refused([](RunConfig& c) { c.train.mlp_tile = -1; }, "train.mlp_tile = -1 must be >= 0");
    refused(
        [](RunConfig& c) {
            c.world = 2;
            c.train.tp = 2;
            c.train.sequence_parallel = true;
        },
        "train.mlp_tile = 64 does not run with train.sequence_parallel = true");
    // int8 fields: every tile a whole number of 256-value blocks (ln_2's rows are 16 values).
    refused(
        [](RunConfig& c) {
            c.train.cpu_activations = "int8";
            c.train.mlp_tile = 6;
        },
        "train.mlp_tile = 6 with train.cpu_activations = \"int8\": a tile of 6 rows is not a "
        "whole number of the 256-value int8 blocks of each tiled width (16, ");
}

TEST(Trainer, SgdRunsAndResumes) {
    auto dir = test::temp_dir("trainer_sgd");
    RunConfig c = test::tiny_run(dir, 4);
    c.optim.name = "sgd";
    c.optim.lr = 0.05;
    Trainer t(c, opts("", 2));
    t.run();
    Trainer r(c, opts(c.io.out_dir));
    EXPECT_EQ(r.run().steps_done, 4);
    RunConfig other = c;
    other.optim.name = "adamw";
    EXPECT_THROW(Trainer(other, opts(c.io.out_dir)), Error);
}

TEST(Trainer, CheckpointHoldsHuggingFaceNamesAndNoTemporaries) {
    auto dir = test::temp_dir("trainer_ckpt");
    RunConfig c = test::tiny_run(dir, 2);
    Trainer t(c, opts());
    auto s = t.run();
    auto f = io::SafetensorsFile::open(s.last_checkpoint + "/model.safetensors");
    const auto& wte = f.get("wte.weight");
    EXPECT_EQ(wte.shape, (std::vector<int64_t>{50, 16}));  // unpadded
    EXPECT_NE(f.find("h.1.mlp.c_proj.weight"), nullptr);
    EXPECT_EQ(f.get("h.0.attn.c_attn.weight").shape, (std::vector<int64_t>{16, 48}));
    EXPECT_TRUE(fs::exists(s.last_checkpoint + "/config.json"));
    EXPECT_TRUE(fs::exists(s.last_checkpoint + "/training_state.safetensors"));
    for (const auto& e : fs::directory_iterator(c.io.out_dir))
        EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
    // Loading the exported weights into a fresh model reproduces them exactly.
    GPT g(c.model);
    load_hf_weights(g, s.last_checkpoint + "/model.safetensors");
    EXPECT_EQ(0, std::memcmp(g.params(), t.model().params(), g.num_params() * 4));
}

TEST(Trainer, CorruptCheckpointIsRejectedByName) {
    auto dir = test::temp_dir("trainer_corrupt");
    RunConfig c = test::tiny_run(dir, 2);
    Trainer t(c, opts());
    auto s = t.run();
    std::string st = s.last_checkpoint + "/training_state.safetensors";
    fs::resize_file(st, fs::file_size(st) / 2);
    try {
        Trainer r(c, opts(c.io.out_dir));
        FAIL() << "expected an error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("training_state.safetensors"), std::string::npos)
            << e.what();
    }
}

TEST(Trainer, InitFromHuggingFaceWeights) {
    auto dir = test::temp_dir("trainer_init_from");
    RunConfig c = test::tiny_run(dir, 1);
    Trainer t(c, opts());
    auto s = t.run();
    RunConfig c2 = test::tiny_run(test::temp_dir("trainer_init_from2"), 1);
    c2.model.init_from = s.last_checkpoint + "/model.safetensors";
    c2.train.max_steps = 0;
    Trainer t2(c2, opts());
    EXPECT_EQ(0, std::memcmp(t2.model().params(), t.model().params(), t.model().num_params() * 4));
    RunConfig c3 = c2;
    c3.model.n_embd = 32;
    EXPECT_THROW(Trainer(c3, opts()), Error);
}

TEST(Config, UnknownKeySuggestsNearest) {
    try {
        parse_run_config("[model]\nn_layr = 4\n", "x.toml", {});
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("did you mean 'model.n_layer'"), std::string::npos)
            << e.what();
    }
    try {
        parse_run_config("", "x.toml", {"trian.max_steps=3"});
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("train.max_steps"), std::string::npos) << e.what();
    }
}

TEST(Config, WrongTypesAndValuesAreNamed) {
    try {
        parse_run_config("[model]\nn_layer = \"six\"\n", "x.toml", {});
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("model.n_layer must be an integer"), std::string::npos)
            << e.what();
    }
    EXPECT_THROW(parse_run_config("[model\n", "x.toml", {}), Error);
    EXPECT_THROW(parse_run_config("", "x", {"train.max_steps=abc"}), Error);
    EXPECT_THROW(parse_run_config("", "x", {"noequals"}), Error);
    RunConfig c = parse_run_config("", "x", {"train.batch_size=6", "train.micro_batch_size=4"});
    EXPECT_THROW(validate_config(c), Error);
    RunConfig d = parse_run_config("[optim]\nlr = 1\n", "x", {"optim.schedule=wsd"});
    EXPECT_EQ(d.optim.lr, 1.0);
    EXPECT_EQ(d.optim.schedule, "wsd");
}

// A batch that does not split over the data-parallel ranks is refused naming what the config
// holds and what memtrain derived (issue 26): an unset micro-batch is never shown as a value.
TEST(Config, BatchSplitRefusalNamesGivenAndDerivedValues) {
    auto refusal = [](const std::vector<std::string>& sets, int world) {
        RunConfig c = parse_run_config("", "x", sets);
        c.world = world;
        return test::error_of([&] { validate_config(c); });
    };
    std::string m = refusal({"train.batch_size=7"}, 2);
    EXPECT_NE(m.find("train.batch_size = 7 (the global batch) does not split evenly over 2 "
                     "data-parallel ranks (the processes of mpirun -np 2)"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("train.micro_batch_size not set"), std::string::npos) << m;
    EXPECT_EQ(m.find("train.micro_batch_size ="), std::string::npos) << m;
    m = refusal({"train.batch_size=8", "train.micro_batch_size=3"}, 2);
    EXPECT_NE(m.find("must be a multiple of train.micro_batch_size = 3 x 2 data-parallel ranks "
                     "(the processes of mpirun -np 2) = 6"),
              std::string::npos)
        << m;
    m = refusal({"train.batch_size=12", "train.micro_batch_size=4", "train.pp=2"}, 4);
    EXPECT_NE(m.find("2 data-parallel ranks (derived: 4 processes / (train.tp 1 x train.pp 2))"),
              std::string::npos)
        << m;
    m = refusal({"train.batch_size=4", "train.micro_batch_size=5"}, 1);
    EXPECT_NE(m.find("train.micro_batch_size = 5 on each of 1 data-parallel rank (one process) is "
                     "5 sequences, more than train.batch_size = 4"),
              std::string::npos)
        << m;
}

TEST(Config, BatchInTokens) {
    RunConfig c = parse_run_config("[train]\nseq_len = 64\nbatch_tokens = 512\n", "x", {});
    EXPECT_EQ(c.train.batch_size, 8);
    EXPECT_THROW(parse_run_config("[train]\nseq_len = 64\nbatch_tokens = 500\n", "x", {}), Error);
}

TEST(Config, ResolvedTomlRoundTrips) {
    RunConfig c = parse_run_config("[model]\nn_layer = 3\n[data]\ntrain = \"a b.bin\"\n", "x",
                                   {"optim.lr=0.002"});
    RunConfig d = parse_run_config(to_toml(c), "resolved", {});
    EXPECT_EQ(to_toml(c), to_toml(d));
    EXPECT_EQ(d.model.n_layer, 3);
    EXPECT_EQ(d.data.train, "a b.bin");
    EXPECT_EQ(d.optim.lr, 0.002);
}

TEST(Config, UnknownKeysSuggestAcrossSections) {
    auto message = [](const std::string& toml, std::vector<std::string> sets = {}) {
        try {
            parse_run_config(toml, "x.toml", sets);
        } catch (const Error& e) {
            return std::string(e.what());
        }
        ADD_FAILURE() << "no error for " << toml;
        return std::string();
    };
    auto m = message("[train]\nlr = 1e-3\n");
    EXPECT_NE(m.find("unknown config key 'train.lr'; did you mean 'optim.lr'? (lr is a key of "
                     "[optim], not of [train])"),
              std::string::npos)
        << m;
    m = message("[optimizer]\nlr = 1e-3\n");
    EXPECT_NE(m.find("did you mean 'optim.lr'? (there is no section [optimizer]; the section is "
                     "[optim])"),
              std::string::npos)
        << m;
    m = message("lr = 1e-3\n");
    EXPECT_NE(m.find("did you mean 'optim.lr'? (keys go under a [section])"), std::string::npos)
        << m;
    m = message("[optimizer]\n");
    EXPECT_NE(m.find("unknown config section [optimizer]; did you mean [optim]?"),
              std::string::npos)
        << m;
    m = message("", {"trian.steps=3"});
    EXPECT_NE(m.find("did you mean 'train.max_steps'?"), std::string::npos) << m;
    m = message("[training]\nbatch_size = 3\n");
    EXPECT_NE(m.find("did you mean 'train.batch_size'?"), std::string::npos) << m;
    m = message("", {"train.zzzzzzzz=1"});
    EXPECT_EQ(m.find("did you mean"), std::string::npos) << m;
    EXPECT_NE(m.find("--help-keys"), std::string::npos) << m;
}

// What users of Hugging Face, DeepSpeed and nanoGPT type is answered with memtrain's key, and
// every unknown key of a file is reported at once (not one per run).
TEST(Config, PeersKeysNameMemtrainsAndEveryUnknownKeyIsReportedAtOnce) {
    const std::string m = test::error_of([] {
        parse_run_config(
            "[train]\ngradient_accumulation_steps = 4\nlearning_rate = 3e-4\nmax_steps = 10\n"
            "resid_pdrop = 0.1\n[model]\ndropout = 0.1\nn_layer = 2\n[optim]\nlrr = 1e-3\n",
            "hf.toml", {});
    });
    EXPECT_NE(m.find("4 unknown config keys"), std::string::npos) << m;
    EXPECT_NE(m.find("hf.toml: unknown config key 'train.gradient_accumulation_steps'; memtrain's "
                     "is 'train.micro_batch_size' (memtrain derives accumulation: "
                     "train.batch_size / (train.micro_batch_size x data-parallel ranks))"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("unknown config key 'train.learning_rate'; memtrain's is 'optim.lr'"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("unknown config key 'train.resid_pdrop'; memtrain's is 'model.dropout' (one "
                     "probability for attention, residual and embedding)"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("unknown config key 'optim.lrr'; did you mean 'optim.lr'?"), std::string::npos)
        << m;
    // One unknown key: its line alone, as before.
    const std::string one =
        test::error_of([] { parse_run_config("[io]\nsave_total_limit = 3\n", "one.toml", {}); });
    EXPECT_EQ(one,
              "one.toml: unknown config key 'io.save_total_limit'; memtrain's is "
              "'io.keep_last'");
}

// Valid configs a user probably did not mean are warned about, each in one line.
TEST(Config, WarningsForAWarmupAsLongAsTheRunAShortPipelineLoraOverARandomBaseAndAdafactorsLr) {
    RunConfig c;
    c.train.max_steps = 100;
    c.optim.warmup_steps = 10;
    c.train.batch_size = 8;
    c.train.micro_batch_size = 2;
    EXPECT_TRUE(config_warnings(c).empty());
    c.optim.warmup_steps = 100;
    auto w = config_warnings(c);
    ASSERT_EQ(w.size(), 1u);
    EXPECT_NE(w[0].find("optim.warmup_steps = 100 is not below train.max_steps = 100"),
              std::string::npos)
        << w[0];
    c.optim.warmup_steps = 10;
    c.train.pp = 8;  // 4 micro-batches for 8 stages
    c.world = 8;
    w = config_warnings(c);
    ASSERT_EQ(w.size(), 1u);
    EXPECT_NE(w[0].find("train.pp = 8 stages with 4 micro-batches per step: the pipeline never "
                        "fills and idles at least 64%"),
              std::string::npos)
        << w[0];
    c.train.pp = 4;
    c.world = 4;
    EXPECT_TRUE(config_warnings(c).empty());
    c.lora.rank = 8;
    w = config_warnings(c);
    ASSERT_EQ(w.size(), 1u);
    EXPECT_NE(w[0].find("LoRA (lora.rank = 8) without model.init_from"), std::string::npos) << w[0];
    c.model.init_from = "base";
    EXPECT_TRUE(config_warnings(c).empty());
    c.optim.name = "adafactor";
    c.optim.lr = 6e-4;
    w = config_warnings(c);
    ASSERT_EQ(w.size(), 1u);
    EXPECT_NE(w[0].find("optim.name = \"adafactor\" with optim.lr = 0.0006"), std::string::npos)
        << w[0];
    c.optim.lr = 3e-2;
    EXPECT_TRUE(config_warnings(c).empty());
}

// --resume's layering: the checkpoint's config, then the file's keys, then --set.
TEST(Config, LayersOverABase) {
    RunConfig base;
    base.model.n_layer = 5;
    base.train.max_steps = 3;
    base.train.seq_len = 64;
    base.train.batch_tokens = 512;
    base.train.batch_size = 8;
    RunConfig c = parse_run_config("[train]\nmax_steps = 7\n", "x", {"optim.lr=0.01"}, &base);
    EXPECT_EQ(c.model.n_layer, 5);
    EXPECT_EQ(c.train.max_steps, 7);
    EXPECT_EQ(c.optim.lr, 0.01);
    EXPECT_EQ(c.train.batch_size, 8);
    // A batch_size given over a base measured in tokens replaces the tokens.
    c = parse_run_config("", "x", {"train.batch_size=4"}, &base);
    EXPECT_EQ(c.train.batch_size, 4);
    EXPECT_EQ(c.train.batch_tokens, 0);
}

TEST(Config, TableIsShortAndHoldsEveryValue) {
    RunConfig c = load_run_config(std::string(MT_SOURCE_DIR) + "/configs/demo.toml", {});
    // The data paths are resolved to absolute ones under the checkout; the table is judged as a
    // checkout at /memtrain prints it, so that where this one was cloned cannot add lines.
    for (std::string* p : {&c.data.train, &c.data.val, &c.data.tokenizer, &c.model.init_from})
        if (p->rfind(MT_SOURCE_DIR, 0) == 0)
            *p = "/memtrain" + p->substr(std::strlen(MT_SOURCE_DIR));
    const std::string t = format_table(c);
    int lines = 0;
    std::istringstream in(t);
    for (std::string l; std::getline(in, l); lines++) EXPECT_LE(l.size(), 100u) << l;
    EXPECT_LE(lines, 24) << t;  // (about five keys a line)
    for (const auto& k : config_keys()) {
        const std::string leaf = k.substr(k.find('.') + 1, k.find(' ') - k.find('.') - 1);
        EXPECT_NE(t.find(" " + leaf + "="), std::string::npos) << leaf << "\n" << t;
    }
}

// train.micro_batch_size = "auto" (issue 27): the largest micro-batch whose run fits the host is
// chosen from the plan before anything is allocated; the run is the same as with that number
// given, allocates what its plan said, and a host too small for one sequence is refused naming
// the need. The key reads and prints as "auto".
TEST(Config, AutoMicroBatchIsTheLargestThatFits) {
    RunConfig parsed = parse_run_config("[train]\nmicro_batch_size = \"auto\"\n", "x.toml", {});
    EXPECT_EQ(parsed.train.micro_batch_size, TrainConfig::kAutoMicroBatch);
    EXPECT_NE(to_toml(parsed).find("micro_batch_size = 'auto'"), std::string::npos);
    EXPECT_EQ(parse_run_config("", "x", {"train.micro_batch_size=auto"}).train.micro_batch_size,
              TrainConfig::kAutoMicroBatch);
    const std::string dir = test::temp_dir("auto_micro_batch");
    RunConfig c = test::tiny_run(dir, 3);
    c.train.batch_size = 8;
    c.train.micro_batch_size = TrainConfig::kAutoMicroBatch;
    c.io.save_final = false;
    // What each micro-batch needs, as the plan prices it.
    auto need = [&](int mb) {
        RunConfig x = c;
        x.train.micro_batch_size = mb;
        x.world = 1;
        return host_need(x).most;
    };
    const std::size_t budget = (need(4) + need(8)) / 2;  // 4 fits, 8 does not
    ASSERT_LT(need(4), budget);
    setenv("MEMTRAIN_HOST_MEMORY", std::to_string(budget).c_str(), 1);
    TrainOptions o;
    o.quiet = true;
    Trainer automatic(c, o);
    const TrainSummary a = automatic.run();
    EXPECT_EQ(automatic.config().train.micro_batch_size, 4);
    EXPECT_EQ(automatic.config().accum_steps(), 2);
    EXPECT_EQ(automatic.engine().memory().snapshot().peak_total_used, need(4));
    unsetenv("MEMTRAIN_HOST_MEMORY");
    RunConfig given = c;
    given.train.micro_batch_size = 4;
    given.io.out_dir = dir + "/given";
    Trainer explicit_run(given, o);
    const TrainSummary g = explicit_run.run();
    EXPECT_EQ(a.losses, g.losses);
    // Nothing fits: one line naming the smallest micro-batch's need.
    setenv("MEMTRAIN_HOST_MEMORY", "1KiB", 1);
    RunConfig tiny_host = c;
    tiny_host.io.out_dir = dir + "/none";
    const std::string m = test::error_of([&] { Trainer t(tiny_host, o); });
    unsetenv("MEMTRAIN_HOST_MEMORY");
    EXPECT_NE(m.find("no micro-batch fits"), std::string::npos) << m;
    EXPECT_NE(m.find("even 1 sequence per micro-batch needs"), std::string::npos) << m;
    RunConfig gpu = c;
    gpu.train.device = "cuda";
    dist::LocalCommunicator one;
    const std::string g2 = test::error_of([&] { resolve_micro_batch(gpu, one); });
    // (Where no GPU answers; tests/cuda/cli_sim_test.cpp chooses one on the simulated device.)
    if (!cuda_available()) {
        EXPECT_NE(g2.find("on train.device = \"cuda\": no device answers"), std::string::npos)
            << g2;
    }
}
