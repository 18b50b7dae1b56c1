// GpuSpec and ClusterSpec: what the planner needs to know about a machine.
// Presets hold datasheet numbers (dense bf16 peak, HBM, NVLink and per-GPU network
// bandwidth); every field can be overridden from the command line for a custom machine.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace memtrain::plan {

struct GpuSpec {
    std::string name = "custom";
    double memory_bytes = 80e9;      // HBM capacity as the datasheet gives it (decimal GB)
    double peak_flops = 989e12;      // dense bf16/fp16 tensor-core FLOP/s
    double peak_flops_fp32 = 67e12;  // plain fp32 (no TF32) FLOP/s, for precision "fp32"
    double hbm_bandwidth = 3.35e12;  // bytes/s, bounds the optimizer step
    double intra_node_bw = 450e9;    // bytes/s per GPU per direction (NVLink)
    double inter_node_bw = 50e9;     // bytes/s per GPU per direction (InfiniBand)
    double pcie_bw = 25e9;           // bytes/s host<->device, for offload
    // Fraction of peak a GEMM whose tiles fill whole waves reaches, before the K loop and
    // memory-bound losses (time_model.h gemm_efficiency); calibrated on published runs.
    double efficiency = 0.64;
    int sms = 132;  // streaming multiprocessors (CUs): a GEMM's tiles run in waves
    // Host memory of a typical node per GPU (a DGX H100's 2 TB for 8 GPUs: 256 GB), bytes.
    double host_memory_per_gpu = 256e9;
    std::string host_memory_source;  // the node it comes from, for the output ("" for custom)
    bool bf16 = true;                // bf16 tensor cores (Volta has fp16 only)
};

struct ClusterSpec {
    GpuSpec gpu;
    int gpus = 8;
    int gpus_per_node = 8;
    double cpu_adam_params_per_s = 1e9;  // CPU optimizer speed per GPU's shard (offload)
    // Host memory per node for offloaded states (--host-mem-gb); unset: the GPU's typical node,
    // gpu.host_memory_per_gpu x gpus_per_node. Always checked: there is no unlimited host.
    std::optional<double> host_memory_bytes;
    int nodes() const { return (gpus + gpus_per_node - 1) / gpus_per_node; }
    double host_memory() const {
        return host_memory_bytes ? *host_memory_bytes : gpu.host_memory_per_gpu * gpus_per_node;
    }
};

std::vector<std::string> gpu_preset_names();
// a100-40gb, a100-80gb, h100-80gb, h200, v100-16gb, v100-32gb, a10g, l4, l40s, rtx-4090,
// mi300x; unknown names fail with the nearest preset.
GpuSpec gpu_preset(const std::string& name);

}  // namespace memtrain::plan
