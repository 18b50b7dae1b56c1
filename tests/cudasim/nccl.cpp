// The NCCL calls memtrain makes, reimplemented for cudasim over MPI (see sim.h): "device"
// buffers are host memory here, so each collective is the MPI collective on them, queued on the
// stream like any other work (and recorded when the stream is being captured). bf16 and fp16 are
// summed in fp32 and rounded once, where NCCL rounds after each step of its ring: results agree
// to a rounding of the type. Lets the CUDA engine's data parallelism run under mpirun in CI.
#include <mpi.h>
#include <nccl.h>

#include <cstring>
#include <list>
#include <vector>

#include "cudasim/sim.h"

// A send in flight: MPI_Isend from a copy of the data, taken when the stream reaches the send.
struct PendingSend {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<unsigned char> data;
};

struct ncclComm {
    MPI_Comm mpi = MPI_COMM_NULL;
    int rank = 0, size = 1;
    std::list<PendingSend> sends;  // completed ones are dropped at the next send and at the end
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

// Sums `count` elements at `in` over the ranks into `out` (every rank's full result).
void all_reduce(const void* in, void* out, std::size_t count, ncclDataType_t t, MPI_Comm c) {
    if (t == ncclFloat32 || t == ncclFloat64) {
        MPI_Datatype mt = t == ncclFloat32 ? MPI_FLOAT : MPI_DOUBLE;
        if (in == out)
            MPI_Allreduce(MPI_IN_PLACE, out, (int)count, mt, MPI_SUM, c);
        else
            MPI_Allreduce(in, out, (int)count, mt, MPI_SUM, c);
        return;
    }
    std::vector<float> f(count);
    for (std::size_t i = 0; i < count; i++) f[i] = to_f32(t, in, i);
    MPI_Allreduce(MPI_IN_PLACE, f.data(), (int)count, MPI_FLOAT, MPI_SUM, c);
    for (std::size_t i = 0; i < count; i++) from_f32(t, out, i, f[i]);
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
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
        for (PendingSend& p : comm->sends) MPI_Wait(&p.request, MPI_STATUS_IGNORE);
        MPI_Comm_free(&comm->mpi);
    }
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    delete comm;
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
    cudasim::enqueue(stream, [=] { all_reduce(send, recv, count, t, comm->mpi); });
    return ncclSuccess;
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    if (!comm || op != ncclSum || !supported(t)) return ncclInvalidArgument;
    cudasim::enqueue(stream, [=] {
        // The whole sum, then this rank's block (recv may lie inside send).
        const std::size_t b = type_bytes(t);
        std::vector<unsigned char> full(count * comm->size * b);
        all_reduce(send, full.data(), count * comm->size, t, comm->mpi);
        std::memmove(recv, full.data() + (std::size_t)comm->rank * count * b, count * b);
    });
    return ncclSuccess;
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t t,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    if (!comm || op != ncclSum || !supported(t) || root < 0 || root >= comm->size)
        return ncclInvalidArgument;
    cudasim::enqueue(stream, [=] {
        // The whole sum on every rank, kept by the root only (recv is ignored elsewhere).
        std::vector<unsigned char> sum(count * type_bytes(t));
        all_reduce(send, sum.data(), count, t, comm->mpi);
        if (comm->rank == root) std::memmove(recv, sum.data(), sum.size());
    });
    return ncclSuccess;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t t,
                           ncclComm_t comm, cudaStream_t stream) {
    if (!comm || !supported(t)) return ncclInvalidArgument;
    cudasim::enqueue(stream, [=] {
        const std::size_t bytes = count * type_bytes(t);
        std::vector<unsigned char> mine(static_cast<const unsigned char*>(send),
                                        static_cast<const unsigned char*>(send) + bytes);
        MPI_Allgather(mine.data(), (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, comm->mpi);
    });
    return ncclSuccess;
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    if (!comm || !supported(t)) return ncclInvalidArgument;
    cudasim::enqueue(stream, [=] {
        const std::size_t bytes = count * type_bytes(t);
        if (comm->rank == root && send != recv) std::memmove(recv, send, bytes);
        MPI_Bcast(recv, (int)bytes, MPI_BYTE, root, comm->mpi);
    });
    return ncclSuccess;
}

// Point to point. A GPU's ncclSend waits, on its stream, for the receive; here streams run their
// work at once, so a send that waited would stop the host thread, and with it every stream of
// the rank. The send instead copies the data (ready, since streams run in order) and leaves it
// to MPI; the receive waits. That is what a send on a stream of its own does on a GPU: the
// sender's other streams go on.
ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    if (!comm || !supported(t) || peer < 0 || peer >= comm->size) return ncclInvalidArgument;
    cudasim::enqueue(stream, [=] {
        comm->sends.remove_if([](PendingSend& p) {
            int done = 0;
            MPI_Test(&p.request, &done, MPI_STATUS_IGNORE);
            return done != 0;
        });
        const std::size_t bytes = count * type_bytes(t);
        PendingSend& p = comm->sends.emplace_back();
        p.data.assign(static_cast<const unsigned char*>(send),
                      static_cast<const unsigned char*>(send) + bytes);
        MPI_Isend(p.data.data(), (int)bytes, MPI_BYTE, peer, 0, comm->mpi, &p.request);
    });
    return ncclSuccess;
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    if (!comm || !supported(t) || peer < 0 || peer >= comm->size) return ncclInvalidArgument;
    cudasim::enqueue(stream, [=] {
        MPI_Recv(recv, (int)(count * type_bytes(t)), MPI_BYTE, peer, 0, comm->mpi,
                 MPI_STATUS_IGNORE);
    });
    return ncclSuccess;
}

}  // extern "C"
