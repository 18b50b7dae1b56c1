// GPU presets from vendor datasheets (dense, no sparsity) and the node each is usually sold in.
// DGX/HGX nodes: A100 with 8x200 Gb/s HDR (25 GB/s per GPU), H100/H200 with 8x400 Gb/s NDR
// (50 GB/s); host memory is the DGX system memory of NVIDIA's datasheets (DGX A100 320GB: 1 TB,
// DGX A100 640GB: 2 TB, DGX H100 and DGX H200: 2 TB, each for 8 GPUs), counted as 1024 and 2048
// decimal GB: an HGX node from another vendor is often built the same way. Cards without NVLink
// (A10G, L4, L40S, RTX 4090) talk over PCIe inside a node; their nodes are the cloud instances
// that hold 8 of them. docs/planner.md, "GPU presets", lists every number with its source.
#include "planner/hardware.h"

#include <fmt/ranges.h>

#include "core/error.h"
#include "planner/nearest.h"

namespace memtrain::plan {

namespace {

GpuSpec make(std::string name, int sms, double mem_gb, double tflops, double fp32_tflops,
             double hbm_tbs, double nvlink_gbs, double net_gbs, double pcie_gbs,
             double node_host_gb, std::string node, bool bf16 = true) {
    GpuSpec g;
    g.sms = sms;
    g.name = std::move(name);
    g.memory_bytes = mem_gb * 1e9;
    g.peak_flops = tflops * 1e12;
    g.peak_flops_fp32 = fp32_tflops * 1e12;
    g.hbm_bandwidth = hbm_tbs * 1e12;
    g.intra_node_bw = nvlink_gbs * 1e9;
    g.inter_node_bw = net_gbs * 1e9;
    g.pcie_bw = pcie_gbs * 1e9;
    g.host_memory_per_gpu = node_host_gb / 8 * 1e9;
    g.host_memory_source = fmt::format("as in a {}: {:g} GB for 8 GPUs", node, node_host_gb);
    g.bf16 = bf16;
    return g;
}

const std::vector<GpuSpec>& gpu_presets() {
    static const std::vector<GpuSpec> table = {
        make("a100-40gb", 108, 40, 312, 19.5, 1.555, 300, 25, 25, 1024, "DGX A100 320GB"),
        make("a100-80gb", 108, 80, 312, 19.5, 2.039, 300, 25, 25, 2048, "DGX A100 640GB"),
        make("h100-80gb", 132, 80, 989, 67, 3.35, 450, 50, 50, 2048, "DGX H100"),
        make("h200", 132, 141, 989, 67, 4.8, 450, 50, 50, 2048, "DGX H200"),
        // Volta has fp16 tensor cores and no bf16: plans default to fp16 there.
        make("v100-16gb", 80, 16, 125, 15.7, 0.9, 150, 6.25, 12.5, 512, "DGX-1 (V100)", false),
        make("v100-32gb", 80, 32, 125, 15.7, 0.9, 150, 6.25, 12.5, 512, "DGX-1 (V100)", false),
        // PCIe cards: GPU to GPU over PCIe 4.0 (25 GB/s each way, as the A100's host link).
        make("a10g", 80, 24, 70, 35, 0.6, 25, 1.5625, 25, 768, "AWS g5.48xlarge"),
        make("l4", 58, 24, 121, 30.3, 0.3, 25, 1.5625, 25, 768, "AWS g6.48xlarge"),
        make("l40s", 142, 48, 362, 91.6, 0.864, 25, 6.25, 25, 1536, "AWS g6e.48xlarge"),
        // GeForce: bf16 with fp32 accumulation runs at half the fp16-accumulate rate.
        make("rtx-4090", 128, 24, 82.6, 82.6, 1.008, 25, 1.5625, 25, 512,
             "8-GPU RTX 4090 server with 100 Gb/s Ethernet"),
        make("mi300x", 304, 192, 1307, 163.4, 5.3, 448, 50, 50, 2048, "8-GPU MI300X platform"),
    };
    return table;
}

}  // namespace

std::vector<std::string> gpu_preset_names() {
    std::vector<std::string> names;
    for (const auto& g : gpu_presets()) names.push_back(g.name);
    return names;
}

GpuSpec gpu_preset(const std::string& name) {
    if (name == "custom") return GpuSpec{};  // H100-like defaults, meant to be overridden
    for (const auto& g : gpu_presets())
        if (g.name == name) return g;
    fail(
        "unknown GPU \"{}\"; did you mean {}? (presets: {}; or --gpu custom with "
        "--gpu-mem-gb, --gpu-tflops, --hbm-bw-gbs and, as the run needs them, --intra-bw-gbs, "
        "--inter-bw-gbs, --pcie-bw-gbs, --gpu-fp32-tflops)",
        name,
        did_you_mean(name, gpu_preset_names(),
                     {{"h100", "h100-80gb"},
                      {"h100-sxm", "h100-80gb"},
                      {"h200-141gb", "h200"},
                      {"4090", "rtx-4090"},
                      {"rtx4090", "rtx-4090"},
                      {"geforce-rtx-4090", "rtx-4090"},
                      {"mi300", "mi300x"},
                      {"l40s-48gb", "l40s"},
                      {"l4-24gb", "l4"},
                      {"a10g-24gb", "a10g"}}),
        fmt::format("{}", fmt::join(gpu_preset_names(), ", ")));
}

}  // namespace memtrain::plan
