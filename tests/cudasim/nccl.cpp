// The NCCL calls memtrain makes, reimplemented for cudasim over MPI (see sim.h): "device"
// buffers are host memory here, so each collective is the non-blocking MPI collective on them,
// queued on the stream like any other work (and recorded when the stream is being captured). An
// operation starts when the stream's scheduler reaches it, in the communicator's issue order
// (queue.h), and the stream's later work waits until MPI completes it, while the process's other
// streams go on, as on a GPU. bf16 and fp16 are summed in fp32 and rounded once, where NCCL
// rounds after each step of its ring: results agree to a rounding of the type. Lets the CUDA
// engine's data parallelism and pipelines run under mpirun in CI.
#include <mpi.h>
#include <nccl.h>

#include <cstring>
#include <functional>
#include <list>
#include <memory>
#include <vector>

#include "cudasim/sim.h"

struct ncclComm {
    MPI_Comm mpi = MPI_COMM_NULL;
    int rank = 0, size = 1;
    bool aborted = false;  // after ncclCommAbort: queued operations complete as no-ops
};

namespace {

std::size_t type_bytes(ncclDataType_t t) {
    switch (t) {
        case ncclFloat64:
            return 8;
        case ncclFloat32:
            return 4;
        case ncclBfloat16:
        case ncclFloat16:
            return 2;
        default:
            return 0;
    }
}

float to_f32(ncclDataType_t t, const void* p, std::size_t i) {
    if (t == ncclBfloat16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    return __half2float(static_cast<const __half*>(p)[i]);
}

void from_f32(ncclDataType_t t, void* p, std::size_t i, float v) {
    if (t == ncclBfloat16)
        static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
    else
        static_cast<__half*>(p)[i] = __float2half_rn(v);
}

bool mpi_finalized() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    return finalized != 0;
}

// An operation in flight: its MPI request, the buffers it owns, and what to do once complete.
struct Op {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<unsigned char> bytes;
    std::vector<float> floats;
    std::function<void()> finish;
};

// Queues an operation on `stream`: `start` posts the MPI request when the stream reaches it;
// the stream's later work waits until the request completes and `op->finish` has run.
void queue_op(ncclComm_t comm, cudaStream_t stream, std::function<void(Op&)> start) {
    auto op = std::make_shared<Op>();
    cudasim::enqueue_async(
        stream, comm,
        [comm, op, start = std::move(start)] {
            if (!comm->aborted && !mpi_finalized()) start(*op);
        },
        [comm, op] {
            if (op->request != MPI_REQUEST_NULL) {
                if (comm->aborted || mpi_finalized()) return true;
                int done = 0;
                MPI_Test(&op->request, &done, MPI_STATUS_IGNORE);
                if (!done) return false;
            }
            if (op->finish) op->finish();
            op->bytes.clear();
            op->floats.clear();
            return true;
        });
}

// Starts the sum of `count` elements at `in` over the ranks into `out` (every rank's result).
void start_all_reduce(Op& op, const void* in, void* out, std::size_t count, ncclDataType_t t,
                      MPI_Comm c) {
    if (t == ncclFloat32 || t == ncclFloat64) {
        MPI_Datatype mt = t == ncclFloat32 ? MPI_FLOAT : MPI_DOUBLE;
        if (in == out)
            MPI_Iallreduce(MPI_IN_PLACE, out, (int)count, mt, MPI_SUM, c, &op.request);
        else
            MPI_Iallreduce(in, out, (int)count, mt, MPI_SUM, c, &op.request);
        return;
    }
    op.floats.resize(count);
    for (std::size_t i = 0; i < count; i++) op.floats[i] = to_f32(t, in, i);
    MPI_Iallreduce(MPI_IN_PLACE, op.floats.data(), (int)count, MPI_FLOAT, MPI_SUM, c, &op.request);
    op.finish = [&op, out, count, t] {
        for (std::size_t i = 0; i < count; i++) from_f32(t, out, i, op.floats[i]);
    };
}

// Sends whose data MPI may still be reading: kept until MPI is done with them.
struct PendingSend {
    MPI_Request request;
    std::shared_ptr<std::vector<unsigned char>> data;
};
std::list<PendingSend>& pending_sends() {
    static auto* l = new std::list<PendingSend>;
    return *l;
}
void reap_sends() {
    pending_sends().remove_if([](PendingSend& p) {
        if (mpi_finalized()) return true;
        int done = 0;
        MPI_Test(&p.request, &done, MPI_STATUS_IGNORE);
        return done != 0;
    });
}

bool supported(ncclDataType_t t) {
    return type_bytes(t) > 0;
}

}  // namespace

extern "C" {

const char* ncclGetErrorString(ncclResult_t result) {
    switch (result) {
        case ncclSuccess:
            return "no error";
        case ncclInvalidArgument:
            return "invalid argument (cudasim NCCL)";
        case ncclInvalidUsage:
            return "invalid usage (cudasim NCCL)";
        default:
            return "unhandled error (cudasim NCCL)";
    }
}

// A communicator's id names its root (the world rank that made it) and that rank's count of ids
// so far: the ranks given one id form the communicator. Every rank of the world creates a
// communicator at the same time (MPI_Comm_split is collective over the world), as memtrain
// does: the whole world, or each rank its group of a mesh (the pipeline's stages, a stage's
// replicas) side by side.
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    static int made = 0;
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) return ncclInvalidUsage;
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    const int name[2] = {world_rank, made++};
    std::memset(id, 0, sizeof(*id));
    std::memcpy(id->internal, "cudasim", 7);
    std::memcpy(id->internal + 8, name, sizeof(name));
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited || std::memcmp(id.internal, "cudasim", 7) != 0) return ncclInvalidUsage;
    int name[2];
    std::memcpy(name, id.internal + 8, sizeof(name));
    auto* c = new ncclComm;
    MPI_Comm_split(MPI_COMM_WORLD, name[0] * 65536 + name[1] % 65536, rank, &c->mpi);
    MPI_Comm_rank(c->mpi, &c->rank);
    MPI_Comm_size(c->mpi, &c->size);
    if (c->rank != rank || c->size != nranks) {
        MPI_Comm_free(&c->mpi);
        delete c;
        return ncclInvalidArgument;
    }
    *comm = c;
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclInvalidArgument;
    cudasim::drain();  // the communicator's queued operations complete first
    if (!mpi_finalized()) MPI_Comm_free(&comm->mpi);
    delete comm;
    return ncclSuccess;
}

// Queued operations may still name the communicator: it is marked, not freed (the process is
// about to fail anyway).
ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (comm) comm->aborted = true;
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
    if (!comm) return ncclInvalidArgument;
    *async_error = ncclSuccess;
    return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t t,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    if (!comm || op != ncclSum || !supported(t)) return ncclInvalidArgument;
    queue_op(comm, stream, [=](Op& o) { start_all_reduce(o, send, recv, count, t, comm->mpi); });
    return ncclSuccess;
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    if (!comm || op != ncclSum || !supported(t)) return ncclInvalidArgument;
    queue_op(comm, stream, [=](Op& o) {
        // The whole sum into a buffer of its own, then this rank's block (recv may lie inside
        // send).
        const std::size_t b = type_bytes(t), n = count * comm->size;
        o.bytes.resize(n * b);
        start_all_reduce(o, send, o.bytes.data(), n, t, comm->mpi);
        auto convert = std::move(o.finish);
        o.finish = [&o, convert, recv, count, b, rank = comm->rank] {
            if (convert) convert();
            std::memmove(recv, o.bytes.data() + (std::size_t)rank * count * b, count * b);
        };
    });
    return ncclSuccess;
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t t,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    if (!comm || op != ncclSum || !supported(t) || root < 0 || root >= comm->size)
        return ncclInvalidArgument;
    queue_op(comm, stream, [=](Op& o) {
        // The whole sum on every rank, kept by the root only (recv is ignored elsewhere).
        o.bytes.resize(count * type_bytes(t));
        start_all_reduce(o, send, o.bytes.data(), count, t, comm->mpi);
        auto convert = std::move(o.finish);
        o.finish = [&o, convert, recv, root, rank = comm->rank] {
            if (convert) convert();
            if (rank == root) std::memmove(recv, o.bytes.data(), o.bytes.size());
        };
    });
    return ncclSuccess;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t t,
                           ncclComm_t comm, cudaStream_t stream) {
    if (!comm || !supported(t)) return ncclInvalidArgument;
    queue_op(comm, stream, [=](Op& o) {
        // From a copy of this rank's piece: it may lie inside recv (an in-place gather).
        const std::size_t bytes = count * type_bytes(t);
        o.bytes.assign(static_cast<const unsigned char*>(send),
                       static_cast<const unsigned char*>(send) + bytes);
        MPI_Iallgather(o.bytes.data(), (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, comm->mpi,
                       &o.request);
    });
    return ncclSuccess;
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    if (!comm || !supported(t)) return ncclInvalidArgument;
    queue_op(comm, stream, [=](Op& o) {
        const std::size_t bytes = count * type_bytes(t);
        if (comm->rank == root && send != recv) std::memmove(recv, send, bytes);
        MPI_Ibcast(recv, (int)bytes, MPI_BYTE, root, comm->mpi, &o.request);
    });
    return ncclSuccess;
}

// Point to point. The send reads its data when its stream reaches it (into a buffer of its own,
// which MPI sends meanwhile) and completes then; the receive completes when the data is there.
ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    if (!comm || !supported(t) || peer < 0 || peer >= comm->size) return ncclInvalidArgument;
    queue_op(comm, stream, [=](Op&) {
        const std::size_t bytes = count * type_bytes(t);
        auto copy = std::make_shared<std::vector<unsigned char>>(
            static_cast<const unsigned char*>(send),
            static_cast<const unsigned char*>(send) + bytes);
        MPI_Request r = MPI_REQUEST_NULL;
        MPI_Isend(copy->data(), (int)bytes, MPI_BYTE, peer, 0, comm->mpi, &r);
        pending_sends().push_back({r, std::move(copy)});
        reap_sends();
    });
    return ncclSuccess;
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    if (!comm || !supported(t) || peer < 0 || peer >= comm->size) return ncclInvalidArgument;
    queue_op(comm, stream, [=](Op& o) {
        MPI_Irecv(recv, (int)(count * type_bytes(t)), MPI_BYTE, peer, 0, comm->mpi, &o.request);
    });
    return ncclSuccess;
}

}  // extern "C"
