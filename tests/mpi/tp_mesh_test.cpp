// Tensor parallelism composed with pipeline stages and data parallelism (train.tp x train.pp x
// pipelines side by side; parallel/mesh.h, engine/cpu/cpu_engine.h, parallel/tensor/tp_views.h)
// under mpirun: at 4 ranks tp 2 x pp 2 and tp 2 x dp 2, at 8 ranks the 2 x 2 x 2 mesh, each with
// and without sequence parallelism, and where there are pipelines side by side with ZeRO-1 across
// them. Each layout trains 10 steps as one process fed the whole global micro-batch (to the
// rounding of the tensor-parallel and data-parallel sums), starts from bitwise the single-process
// weights, and its checkpoint loads exactly (weights and Adam's moments) in one process and in a pp
// 2 x dp 2 job without tensor parallelism, which train on from it as the mesh does; tp 2 x dp 2
// with ZeRO-1 writes the single-process files and resumes from them both ways.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "engine/cpu/cpu_engine.h"
#include "io/checkpoint.h"
#include "mpi/dist_runs.h"
#include "test_util.h"

namespace memtrain::dist {
namespace {

struct MeshDegrees {
    int tp, pp, dp;
    std::string name() const { return fmt::format("tp{}_pp{}_dp{}", tp, pp, dp); }
};

// The layouts of this job's size (none at other sizes).
std::vector<MeshDegrees> meshes() {
    if (comm().size() == 4) return {{2, 2, 1}, {2, 1, 2}};
    if (comm().size() == 8) return {{2, 2, 2}};
    return {};
}

// Heads, kv heads, MLP and vocabulary split over 2 shards; 4 blocks over 2 stages; GPT-2 with a
// tied embedding (its two gradients summed across the stages) or Llama-style with GQA.
RunConfig mesh_run(const std::string& name, const MeshDegrees& m, bool llama, int steps) {
    RunConfig c = shared_tiny_run_config(name, steps);
    c.model.n_head = 8;
    c.model.n_embd = 32;
    c.model.n_layer = 4;
    c.io.save_final = false;
    c.train.eval_every = 5;
    c.train.batch_size = 4 * m.dp;  // 2 micro-batches of 2 rows per pipeline
    c.train.micro_batch_size = 2;
    c.train.tp = m.tp;
    c.train.pp = m.pp;
    if (llama) {
        c.model.norm = "rmsnorm";
        c.model.activation = "swiglu";
        c.model.positions = "rope";
        c.model.tied_embeddings = false;
        c.model.bias = false;
        c.model.n_kv_head = 4;
        c.model.ffn_hidden = 64;
    }
    return c;
}

// One process fed each step's whole global micro-batch (every pipeline's rows at once).
RunConfig mesh_as_one_process(RunConfig c, const std::string& suffix) {
    const int dp = comm().size() / (c.train.tp * c.train.pp);
    c.train.micro_batch_size *= dp;
    c.train.tp = c.train.pp = 1;
    c.train.sequence_parallel = false;
    c.train.zero_stage = 0;
    c.io.out_dir += suffix + std::to_string(comm().rank());
    return c;
}

double worst_diff(const std::vector<float>& a, const std::vector<float>& b) {
    double w = 0;
    for (std::size_t i = 0; i < a.size(); i++) w = std::max(w, (double)std::abs(a[i] - b[i]));
    return w;
}

TEST(TpMesh, LayoutsTrainAsOneProcess) {
    for (const MeshDegrees& m : meshes())
        for (bool llama : {false, true})
            for (bool sp : {false, true})
                for (int zero : {0, 1}) {
                    // ZeRO-1 where there are replicas to shard over: GPT-2 without and Llama with
                    // sequence parallelism (at 8 ranks GPT-2 only, to keep the launch short).
                    if (zero == 1 && (m.dp == 1 || sp != llama || (m.pp > 1 && llama))) continue;
                    const std::string what = m.name() + (llama ? " llama" : " gpt2") +
                                             (sp ? " sequence-parallel" : "") +
                                             (zero ? " zero1" : "");
                    SCOPED_TRACE(what);
                    if (comm().rank() == 0) std::printf("%s\n", what.c_str());
                    const int steps = 10;
                    RunConfig c = mesh_run("tp_mesh_" + m.name(), m, llama, steps);
                    c.train.sequence_parallel = sp;
                    c.train.zero_stage = zero;
                    TrainSummary ref;
                    std::vector<float> ref_init, ref_params;
                    {
                        Trainer t(mesh_as_one_process(c, "_one"), test::quiet());
                        ref_init = t.params();
                        ref = t.run();
                        ref_params = t.params();
                    }
                    Trainer t(c, test::quiet(), &comm());
                    EXPECT_NE(t.engine().describe().find("tensor-parallel shard"),
                              std::string::npos)
                        << t.engine().describe();
                    EXPECT_EQ(t.engine().describe().find("ZeRO-1") != std::string::npos, zero == 1)
                        << t.engine().describe();
                    EXPECT_EQ(t.params(), ref_init) << "initial weights";
                    const TrainSummary s = t.run();
                    ASSERT_EQ(s.losses.size(), ref.losses.size());
                    for (std::size_t i = 0; i < s.losses.size(); i++)
                        EXPECT_NEAR(s.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i]))
                            << "step " << i + 1;
                    ASSERT_EQ(s.val_losses.size(), ref.val_losses.size());
                    for (std::size_t i = 0; i < s.val_losses.size(); i++)
                        EXPECT_NEAR(s.val_losses[i].second, ref.val_losses[i].second,
                                    1e-5 * std::abs(ref.val_losses[i].second));
                    // As in tests/mpi/tp_test.cpp: Adam may turn a gradient that is zero but
                    // for rounding into a step of about the learning rate.
                    EXPECT_LT(worst_diff(t.params(), ref_params), 1e-4 + 1e-3 * c.optim.lr * steps);
                    // The stage's store holds this rank's shard of its units only.
                    auto& e = dynamic_cast<CpuEngine&>(t.engine());
                    const ParamLayout whole = make_param_layout(c.model),
                                      shard = make_param_layout(tp_shard_config(c.model, m.tp));
                    const int u0 = e.stage_store().first_unit(), u1 = e.stage_store().last_unit();
                    EXPECT_EQ(e.stage_store().count(), shard.units[u1].end - shard.units[u0].begin);
                    EXPECT_LT(e.stage_store().count(), whole.units[u1].end - whole.units[u0].begin);
                    // ZeRO-1: this replica's optimizer updates its piece of the shard's range.
                    const dist::ShardRange piece =
                        dist::shard_ranges((int64_t)e.stage_store().count(), m.dp)[e.replica()];
                    EXPECT_EQ(e.update_range().offset, zero ? piece.offset : 0);
                    EXPECT_EQ(e.update_range().count,
                              zero ? piece.count : (int64_t)e.stage_store().count());
                }
}

// Remat that rebuilds block inputs on the mesh: each pipeline chunk of tensor-parallel shards
// rebuilds within itself, re-running the same collectives on every rank of its group, so the
// mesh trains bitwise as the same mesh keeping everything, and each rank allocates what its plan
// predicted.
TEST(TpMesh, RebuiltBlockInputsTrainBitwise) {
    for (const MeshDegrees& m : meshes()) {
        SCOPED_TRACE(m.name());
        RunConfig c = mesh_run("tp_mesh_rebuild_" + m.name(), m, true, 3);
        c.model.n_layer = 6;  // 3 blocks per stage
        c.train.sequence_parallel = true;
        TrainSummary keep;
        std::vector<float> keep_params;
        {
            Trainer t(c, test::quiet(), &comm());
            keep = t.run();
            keep_params = t.params();
        }
        for (const char* remat : {"memory-poor", "chen:2"}) {
            RunConfig r = c;
            r.train.remat = remat;
            r.io.out_dir += std::string("_") + remat;
            const MemoryStats before = host_memory().snapshot();
            Trainer t(r, test::quiet(), &comm());
            EXPECT_EQ(t.run().losses, keep.losses) << remat;
            EXPECT_EQ(t.params(), keep_params) << remat;
            const std::size_t act = host_memory().snapshot()[MemCategory::Activations] -
                                    before[MemCategory::Activations];
            for (const MemoryPrediction& p :
                 t.engine().predicted_memory(r.micro_batch(), r.train.seq_len))
                if (p.category == MemCategory::Activations) {
                    EXPECT_EQ(p.bytes, act) << remat << ": " << p.formula;
                }
        }
    }
}

// train.mlp_tile on the mesh (GPT-2 and Llama-style; no sequence parallelism, which tiles
// refuse): each shard runs its norms and MLP over row tiles, the row-parallel mlp.c_proj summing
// every tile's partial rows in its one all-reduce, so the mesh trains as the untiled mesh to
// rounding, keeping everything and recomputing every block, and allocates the activation bytes
// its plan predicts.
TEST(TpMesh, TiledNormsAndMlpTrainAsTheUntiledMesh) {
    for (const MeshDegrees& m : meshes())
        for (bool llama : {false, true})
            for (const char* remat : {"none", "full"}) {
                SCOPED_TRACE(m.name() + (llama ? " llama " : " gpt2 ") + remat);
                RunConfig c = mesh_run("tp_mesh_tiles_" + m.name(), m, llama, 4);
                c.train.remat = remat;
                c.io.out_dir += std::string(llama ? "_l" : "_g") + remat;
                TrainSummary untiled;
                std::vector<float> untiled_params;
                {
                    Trainer t(c, test::quiet(), &comm());
                    untiled = t.run();
                    untiled_params = t.params();
                }
                RunConfig r = c;
                r.train.mlp_tile = 4;  // 4 tiles of each micro-batch's 16 rows
                r.io.out_dir += "_tiled";
                const MemoryStats before = host_memory().snapshot();
                Trainer t(r, test::quiet(), &comm());
                const TrainSummary s = t.run();
                ASSERT_EQ(s.losses.size(), untiled.losses.size());
                for (std::size_t i = 0; i < s.losses.size(); i++)
                    EXPECT_NEAR(s.losses[i], untiled.losses[i], 1e-5 * std::abs(untiled.losses[i]))
                        << "step " << i + 1;
                EXPECT_LT(worst_diff(t.params(), untiled_params), 1e-5);
                const std::size_t act = host_memory().snapshot()[MemCategory::Activations] -
                                        before[MemCategory::Activations];
                for (const MemoryPrediction& p :
                     t.engine().predicted_memory(r.micro_batch(), r.train.seq_len))
                    if (p.category == MemCategory::Activations) {
                        EXPECT_EQ(p.bytes, act) << p.formula;
                    }
            }
}

// The checkpoint of a mesh, written after 5 of 10 steps, loads exactly in one process and in a
// pp 2 x dp 2 job over the first 4 ranks (weights and both of Adam's moments equal the mesh's,
// gathered); both then train the remaining 5 steps as the mesh does, to rounding. At 8 ranks
// also with ZeRO-1 across the pipelines (the pp 2 x dp 2 job then with ZeRO-1 too).
TEST(TpMesh, CheckpointsReshardToOneProcessAndToPipelines) {
    for (const MeshDegrees& m : meshes())
        for (int zero : {0, 1}) {
            if (zero == 1 && m.pp * m.dp < 4)
                continue;  // tp 2 x dp 2: Zero1CheckpointsRoundTrip...
            SCOPED_TRACE(m.name() + (zero ? " zero1" : ""));
            const int steps = 10, cut = 5;
            RunConfig c = mesh_run("tp_mesh_ckpt_" + m.name(), m, false, steps);
            c.io.save_final = true;
            c.train.zero_stage = zero;
            TrainSummary full;
            {
                Trainer t(c, test::quiet(), &comm());
                full = t.run();
            }
            RunConfig first = c;
            first.io.out_dir += "_first";
            std::vector<float> saved;
            {
                Trainer t(first, test::quiet("", cut), &comm());
                t.run();
                saved = t.params();
            }
            // One process, from the mesh's checkpoint.
            {
                RunConfig one = mesh_as_one_process(c, "_resumed_one");
                Trainer t(one, test::quiet(first.io.out_dir));
                EXPECT_EQ(t.params(), saved) << "weights loaded in one process";
                const TrainSummary s = t.run();
                ASSERT_EQ(s.losses.size(), (std::size_t)(steps - cut));
                for (int i = 0; i < steps - cut; i++)
                    EXPECT_NEAR(s.losses[i], full.losses[cut + i],
                                1e-5 * std::abs(full.losses[cut + i]))
                        << "one process, step " << cut + i + 1;
            }
            // pp 2 x dp 2 over ranks 0-3 (the others wait at the barrier).
            const bool in = comm().rank() < 4;
            std::unique_ptr<Communicator> four =
                comm().split(in ? 0 : 1, comm().rank(), "first four");
            if (in) {
                RunConfig pd = c;
                pd.train.tp = 1;
                pd.train.pp = 2;
                // The same global batch as the mesh's: two pipelines of its rows per micro-batch.
                pd.train.micro_batch_size = c.train.batch_size / 2 / 2;
                pd.io.out_dir += "_resumed_pd";
                if (pd.train.micro_batch_size >= 1) {
                    Trainer t(pd, test::quiet(first.io.out_dir), four.get());
                    EXPECT_EQ(t.params(), saved) << "weights loaded at pp 2 x dp 2";
                    const TrainSummary s = t.run();
                    ASSERT_EQ(s.losses.size(), (std::size_t)(steps - cut));
                    for (int i = 0; i < steps - cut; i++)
                        EXPECT_NEAR(s.losses[i], full.losses[cut + i],
                                    1e-5 * std::abs(full.losses[cut + i]))
                            << "pp 2 x dp 2, step " << cut + i + 1;
                }
            }
            comm().barrier();
        }
}

// tp 2 x dp 2 with ZeRO-1: its checkpoint, written after 5 of 10 steps, holds the
// single-process files (the optimizer state gathered over the data group and the tp group): one
// process loads its weights and Adam's moments bitwise and trains on as the mesh does; and the
// other way, the mesh loads one process's checkpoint bitwise and trains on as one process does.
TEST(TpMesh, Zero1CheckpointsRoundTripWithOneProcess) {
    if (comm().size() != 4) return;
    const MeshDegrees m{2, 1, 2};
    const int steps = 10, cut = 5;
    RunConfig c = mesh_run("tp_mesh_zero1_ckpt", m, false, steps);
    c.train.zero_stage = 1;
    c.io.save_final = true;
    auto expect_close = [&](const TrainSummary& s, const TrainSummary& ref, const char* how) {
        ASSERT_EQ(s.losses.size(), (std::size_t)(steps - cut)) << how;
        for (int i = 0; i < steps - cut; i++)
            EXPECT_NEAR(s.losses[i], ref.losses[cut + i], 1e-5 * std::abs(ref.losses[cut + i]))
                << how << ", step " << cut + i + 1;
    };
    TrainSummary mesh_full, one_full;
    {
        Trainer t(c, test::quiet(), &comm());
        mesh_full = t.run();
    }
    const RunConfig one = mesh_as_one_process(c, "_one");
    {
        Trainer t(one, test::quiet());
        one_full = t.run();
    }
    // The mesh's checkpoint in one process.
    RunConfig first = c;
    first.io.out_dir += "_first";
    std::vector<float> saved;
    std::vector<std::vector<float>> saved_state;
    {
        Trainer t(first, test::quiet("", cut), &comm());
        t.run();
        saved = t.params();
        saved_state = optimizer_state(t);
        EXPECT_NE(t.engine().describe().find("ZeRO-1"), std::string::npos) << t.engine().describe();
    }
    ASSERT_EQ(saved_state.size(), 2u) << "Adam's m and v";
    ASSERT_EQ(saved_state[0].size(), saved.size());
    {
        Trainer t(mesh_as_one_process(c, "_resumed_one"), test::quiet(first.io.out_dir));
        EXPECT_EQ(t.params(), saved) << "weights loaded in one process";
        EXPECT_TRUE(optimizer_state(t) == saved_state) << "Adam's moments loaded in one process";
        expect_close(t.run(), mesh_full, "one process from the mesh");
    }
    // One process's checkpoint (rank 0's) in the mesh.
    RunConfig one_first = mesh_as_one_process(c, "_one_first");
    std::vector<float> one_saved;
    std::vector<std::vector<float>> one_state;
    {
        Trainer t(one_first, test::quiet("", cut));
        t.run();
        one_saved = t.params();
        one_state = optimizer_state(t);
    }
    comm().barrier();                        // rank 0's checkpoint is complete
    std::string dir = one_first.io.out_dir;  // rank 0's: ends in its rank
    dir.replace(dir.size() - std::to_string(comm().rank()).size(), std::string::npos, "0");
    {
        RunConfig resumed = c;
        resumed.io.out_dir += "_resumed_mesh";
        Trainer t(resumed, test::quiet(dir), &comm());
        EXPECT_EQ(t.params(), one_saved) << "weights loaded in the mesh";
        EXPECT_TRUE(optimizer_state(t) == one_state) << "Adam's moments loaded in the mesh";
        expect_close(t.run(), one_full, "the mesh from one process");
    }
    comm().barrier();
}

// What the mesh does not compose with yet is refused before training, naming it.
// The checkpoint's gathers on a tensor-parallel stage (its shard's optimizer state beside every
// shard's, a unit whole beside its pieces) peak at the predicted communication row, on every
// rank of every layout, with ZeRO-1 and sequence parallelism (issue 26).
TEST(TpMesh, CommunicationPeakIsPredicted) {
    for (const MeshDegrees& m : meshes())
        for (int zero : {0, 1}) {
            if (zero == 1 && m.dp == 1) continue;
            RunConfig c = mesh_run("tp_mesh_comm_" + m.name(), m, true, 1);
            c.train.zero_stage = zero;
            c.train.sequence_parallel = zero == 1;
            c.io.save_final = true;
            c.io.out_dir += fmt::format("_z{}", zero);
            Trainer t(c, test::quiet(), &comm());
            t.run();
            const std::size_t predicted = predicted_bytes(t, MemCategory::Communication);
            EXPECT_GT(predicted, 0u) << m.name();
            EXPECT_EQ(t.engine().memory().snapshot().peak(MemCategory::Communication), predicted)
                << m.name() << " zero " << zero << " rank " << comm().rank();
        }
}

TEST(TpMesh, RefusesWhatItDoesNotRun) {
    if (comm().size() != 4) return;
    RunConfig c = mesh_run("tp_mesh_refused", {2, 2, 1}, false, 1);
    RunConfig z = c;
    z.train.pp_schedule = "zb-h1";
    expect_refused(z, "train.tp = 2 does not run with train.pp_schedule = \"zb-h1\"");
    RunConfig i = c;
    i.train.pp_schedule = "interleaved";
    i.train.pp_virtual = 2;
    i.train.batch_size = 8;
    expect_refused(i, "train.pp_virtual > 1");
    for (int zero : {2, 3}) {
        RunConfig d = c;
        d.train.pp = 1;
        d.train.zero_stage = zero;
        expect_refused(
            d, fmt::format(
                   "train.zero_stage = {} with train.tp = 2: with tensor parallelism only ZeRO-1",
                   zero));
    }
}

}  // namespace
}  // namespace memtrain::dist
