// The shared step schedule over parameter units (see unit_walk.h).
#include "model/unit_walk.h"

#include "core/error.h"

namespace memtrain {

Redo redo_for(BlockKeep k) {
    switch (k) {
        case BlockKeep::All:
            return Redo::Nothing;
        case BlockKeep::Selective:
            return Redo::Selective;
        case BlockKeep::Input:
            return Redo::Block;
        case BlockKeep::Offload:
            return Redo::BlockFromHost;
        case BlockKeep::Segment:  // the input first rebuilt (InputRebuild), then as Input
        case BlockKeep::Dropped:
            return Redo::Block;
    }
    fail("internal: BlockKeep {}", (int)k);
}

UnitWalk make_unit_walk(const ParamLayout& layout, int n_layer, bool tied, int b0, int b1,
                        const RematPlan& plan) {
    if (b0 < 0 || b1 > n_layer || b0 >= b1)
        fail("internal: a unit walk over blocks [{}, {}) of {}", b0, b1, n_layer);
    if (!plan.empty() && plan.size() != (std::size_t)(b1 - b0))
        fail("internal: a remat plan of {} blocks for a walk over {}", plan.size(), b1 - b0);
    using Part = UnitVisit::Part;
    const bool embedding = b0 == 0, head = b1 == n_layer;
    const int E = ParamLayout::embedding_unit(), H = layout.head_unit();
    UnitWalk w;
    // Forward: each part announces the next part's unit, the last block the head's (on the last
    // stage), and the head the output embedding when it is wte.
    if (embedding) w.forward.push_back({Part::Embedding, -1, E, layout.block_unit(b0)});
    for (int l = b0; l < b1; l++) {
        const int next = l + 1 < b1 ? layout.block_unit(l + 1) : head ? H : -1;
        w.forward.push_back({Part::Block, l, layout.block_unit(l), next});
    }
    if (head) w.forward.push_back({Part::Head, -1, H, tied ? E : -1});
    // Backward: the head announces the last block while the classifier runs; each block the one
    // before it, or where that one's input is rebuilt (memory-poor, chen:K), the first block its
    // rebuild re-runs (whose unit is acquired first); the embedding's backward reads no
    // parameters.
    const InputRebuild rebuild = plan.empty() ? InputRebuild{} : input_rebuild(plan);
    auto first_used = [&](int m) {  // the unit block m's backward acquires first
        const int from = rebuild.any ? rebuild.from[m - b0] : -1;
        return layout.block_unit(from >= 0 ? b0 + from : m);
    };
    if (head) w.backward.push_back({Part::Head, -1, H, first_used(b1 - 1)});
    for (int l = b1 - 1; l >= b0; l--) {
        const BlockKeep k = plan.empty() ? BlockKeep::All : plan[l - b0];
        w.backward.push_back(
            {Part::Block, l, layout.block_unit(l), l > b0 ? first_used(l - 1) : -1, redo_for(k)});
    }
    if (embedding) w.backward.push_back({Part::Embedding, -1, E, -1});
    return w;
}

}  // namespace memtrain
