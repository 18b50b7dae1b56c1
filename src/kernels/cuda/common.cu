// Out-of-line helpers of common.cuh.
#include "kernels/cuda/common.cuh"

namespace memtrain::cuda {

void launch_fail(const char* kernel, int error, dim3 grid, dim3 block, std::size_t smem) {
    fail("CUDA launch of {} (grid {}x{}x{}, block {}x{}x{}, {} bytes of shared memory) failed: {}",
         kernel, grid.x, grid.y, grid.z, block.x, block.y, block.z, smem,
         cudaGetErrorString(static_cast<cudaError_t>(error)));
}

}  // namespace memtrain::cuda
