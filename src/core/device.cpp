// The device layer as CPU code sees it (core/device.h): the device memory tracker, and the
// questions about devices, answered by the CUDA backend when it is there (core/cuda_backend.h)
// and "no device" when it is not. The rest of core/device.h is core/cuda_device.cpp, part of the
// backend.
#include "core/device.h"

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "core/cuda_backend.h"

namespace memtrain {

namespace {

// Constant-initialised, so a backend linked into the executable can register from its static
// initialiser whatever the order of initialisation.
std::atomic<const CudaDeviceApi*> g_api{nullptr};
std::string* g_status = nullptr;  // why loading failed; set once under the loader's lock

// A GPU driver is installed here: the NVIDIA device nodes (Linux, containers) or WSL's.
bool driver_present() {
    for (const char* node : {"/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"})
        if (::access(node, F_OK) == 0) return true;
    return false;
}

// The backend library: MEMTRAIN_CUDA_BACKEND, else beside the executable, else on the library
// path.
std::string load() {
    std::string path;
    if (const char* v = std::getenv("MEMTRAIN_CUDA_BACKEND"); v && *v) {
        path = v;
    } else {
        if (!driver_present()) return "no GPU driver on this machine (no /dev/nvidiactl)";
        std::error_code ec;
        const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
        const auto beside = exe.parent_path() / "libmemtrain_cuda.so";
        path = !ec && std::filesystem::exists(beside, ec) ? beside.string() : "libmemtrain_cuda.so";
    }
    if (!::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) {
        const char* why = ::dlerror();
        return "the CUDA backend " + path + " could not be loaded (" + (why ? why : "?") +
               "); it is built by `make build` or `cmake --build build --target memtrain_cuda`";
    }
    if (!g_api.load()) return "the CUDA backend " + path + " loaded but did not register";
    return "";
}

}  // namespace

void register_cuda_backend(const CudaDeviceApi* api) {
    g_api.store(api);
}

bool load_cuda_backend() {
    static std::once_flag once;
    std::call_once(once, [] {
        if (g_api.load()) return;
        g_status = new std::string(load());
    });
    return g_api.load() != nullptr;
}

std::string cuda_backend_status() {
    if (load_cuda_backend()) return "";
    return g_status ? *g_status : "not loaded";
}

MemoryTracker& device_memory() {
    static MemoryTracker tracker;
    return tracker;
}

int cuda_device_count() {
    static const int count = load_cuda_backend() ? g_api.load()->device_count() : 0;
    return count;
}

bool cuda_available() {
    return cuda_device_count() > 0;
}

std::string cuda_device_name() {
    return cuda_available() ? g_api.load()->device_name() : "none";
}

void device_synchronize() {
    if (cuda_available()) g_api.load()->synchronize();
}

void select_device(int local_rank) {
    if (cuda_available()) g_api.load()->select(local_rank);
}

std::pair<std::size_t, std::size_t> device_memory_info() {
    return cuda_available() ? g_api.load()->memory_info() : std::pair<std::size_t, std::size_t>{};
}

}  // namespace memtrain
