// The parameter server's layout (engine/cpu/ps_engine.h): which server holds which units, and the
// view of the model's weights that initialisation, import and checkpoints go through.
//
// Servers hold whole units (the embedding, a block, the head), a contiguous run of them each, cut
// where the running size comes closest to an equal share of Ψ, as ps-lite cuts its key range. A
// server's units are one range [begin, end) of the flat buffer, so its optimizer is an ordinary
// optimizer over a range and its checkpoint file is a ZeRO-style slice.
#pragma once

#include <cstddef>
#include <map>
#include <vector>

#include "comm/communicator.h"
#include "core/allocator.h"
#include "model/param_layout.h"
#include "model/unit_store.h"

namespace memtrain::dist {

// Server s holds units [first_unit[s], last_unit[s]], floats [begin[s], end[s]).
struct ServerSplit {
    std::vector<int> first_unit, last_unit;
    std::vector<std::size_t> begin, end;
    int servers() const { return (int)first_unit.size(); }
    std::size_t count(int s) const { return end[s] - begin[s]; }
    // The server holding unit u.
    int server_of(int u) const;
};

// `servers` contiguous groups of units, each non-empty, balanced by size: boundary k goes after
// the unit whose running size is nearest k Ψ / servers (leaving a unit for each later server).
ServerSplit split_servers(const ParamLayout& layout, int servers);

// Where each rank keeps a unit it has: workers a whole replica, servers their own units.
class UnitSource {
  public:
    virtual ~UnitSource() = default;
    // Unit u's floats on this rank, or null where this rank does not keep it.
    virtual float* unit(int u) = 0;
    // Whether reads should leave this rank's copy alone (a worker's replica may be behind the
    // servers under staleness: checkpoints read the servers' values without overwriting it).
    virtual bool read_into_scratch() const = 0;
};

// The model's weights as every rank sees them (ModelWeights) when each unit has one owner rank
// (a parameter server's server, a pipeline's stage): reading a unit broadcasts it from its
// owner; writing one (initialisation, import, resume) writes every rank's own copy, and release
// broadcasts the owner's result so every copy agrees whatever each rank wrote. A collective per
// acquire and written release: every rank makes the same calls in the same order, as with ZeRO-3.
class OwnerWeights final : public WeightWindow {
  public:
    // owner_rank[u]: the rank holding unit u (the one whose values count).
    OwnerWeights(const ParamLayout& layout, UnitSource& source, std::vector<int> owner_rank,
                 Communicator& comm);
    float* acquire(int u, bool for_write = false) override;
    void release(int u) override;

  private:
    struct Held {
        int count = 0;
        bool written = false;
        float* data = nullptr;
        Buffer<float> scratch;  // where this rank keeps no copy (or must not touch it)
    };
    const ParamLayout* layout_;
    UnitSource* source_;
    std::vector<int> owner_;
    Communicator* comm_;
    std::map<int, Held> held_;
};

}  // namespace memtrain::dist
