// The NCCL factory where NCCL was not found at build time (nccl_communicator.cu has the real one).
#if MEMTRAIN_HAVE_CUDA && !MEMTRAIN_HAVE_NCCL
#include "comm/device_communicator.h"

#include "core/error.h"

namespace memtrain::dist {

std::unique_ptr<DeviceCommunicator> make_nccl_communicator(const HostLink& host) {
    fail(
        "{} ranks on train.device = \"cuda\" need NCCL, which this build did not find (rebuild "
        "with NCCL_ROOT set to an NCCL install)",
        host.size);
}

}  // namespace memtrain::dist
#endif
