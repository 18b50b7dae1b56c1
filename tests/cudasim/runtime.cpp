// The CUDA runtime calls memtrain makes, reimplemented for cudasim (see sim.h) with the
// signatures of cuda_runtime_api.h. Device memory is host memory with its allocations recorded,
// so copies can check that a "device" pointer really is one. Streams queue their work and run it
// when a synchronisation needs it (queue.h); each call below keeps its CUDA meaning: what it
// waits for, and what it lets the host do before the device has done it. A stream being
// captured records its work into a graph instead (and, as on a GPU, a capture that meets a
// synchronising call is invalidated, so code that would break CUDA graphs breaks here too).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cudasim/queue.h"
#include "cudasim/sim.h"

struct CUgraph_st {
    std::vector<std::function<void()>> work;
};
struct CUgraphExec_st {
    // Shared with the launches still queued: CUDA frees an executable graph in flight only
    // once its launches have completed.
    std::shared_ptr<const std::vector<std::function<void()>>> work;
};

namespace cudasim {

namespace {

struct State {
    std::mutex mu;
    std::map<uintptr_t, std::size_t> device;  // base -> bytes asked for (copies may not pass them)
    std::map<uintptr_t, std::size_t> pinned;  // page-locked host memory
    std::size_t used = 0;
    std::vector<CUstream_st*> capturing;  // streams being captured (global capture mode)
};

State& state() {
    static State* s = new State;  // never destroyed: frees may come from static destructors
    return *s;
}

thread_local cudaError_t last_error = cudaSuccess;

std::size_t device_bytes() {
    static const std::size_t n = [] {
        const char* v = std::getenv("MEMTRAIN_SIM_DEVICE_MIB");
        long long mib = v ? std::atoll(v) : 0;
        return (std::size_t)(mib > 0 ? mib : 81559) << 20;
    }();
    return n;
}

cudaError_t fail(cudaError_t e) {
    last_error = e;
    return e;
}

bool in_map(const std::map<uintptr_t, std::size_t>& m, const void* p, std::size_t bytes) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = m.upper_bound(a);
    if (it == m.begin()) return false;
    --it;
    return a >= it->first && a + bytes <= it->first + it->second;
}

bool is_device(const void* p, std::size_t bytes) {
    std::lock_guard lock(state().mu);
    return in_map(state().device, p, bytes);
}

bool is_pinned(const void* p, std::size_t bytes) {
    std::lock_guard lock(state().mu);
    return in_map(state().pinned, p, bytes);
}

// A synchronising call while some stream is being captured invalidates the capture (the global
// capture mode's rule) and fails.
cudaError_t check_not_capturing() {
    State& st = state();
    std::lock_guard lock(st.mu);
    if (st.capturing.empty()) return cudaSuccess;
    for (CUstream_st* s : st.capturing) s->invalidated = true;
    last_error = cudaErrorStreamCaptureImplicit;
    return cudaErrorStreamCaptureImplicit;
}

// Checks a copy's pointers against its kind; every byte of a device range must be allocated.
cudaError_t check_copy(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind) {
    if (n == 0) return cudaSuccess;
    if (!dst || !src) return cudaErrorInvalidValue;
    const bool dst_dev = is_device(dst, n), src_dev = is_device(src, n);
    switch (kind) {
        case cudaMemcpyHostToDevice:
            return dst_dev ? cudaSuccess : cudaErrorInvalidValue;
        case cudaMemcpyDeviceToHost:
            return src_dev ? cudaSuccess : cudaErrorInvalidValue;
        case cudaMemcpyDeviceToDevice:
            return dst_dev && src_dev ? cudaSuccess : cudaErrorInvalidValue;
        case cudaMemcpyHostToHost:
        case cudaMemcpyDefault:
            return cudaSuccess;
    }
    return cudaErrorInvalidMemcpyDirection;
}

}  // namespace

void set_last_error(cudaError_t e) {
    last_error = e;
}

}  // namespace cudasim

using cudasim::fail;
using cudasim::state;

extern "C" {

// ---- errors
// ----------------------------------------------------------------------------------------
cudaError_t cudaGetLastError(void) {
    cudaError_t e = cudasim::last_error;
    cudasim::last_error = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void) {
    return cudasim::last_error;
}

const char* cudaGetErrorName(cudaError_t error) {
    switch (error) {
        case cudaSuccess:
            return "cudaSuccess";
        case cudaErrorInvalidValue:
            return "cudaErrorInvalidValue";
        case cudaErrorMemoryAllocation:
            return "cudaErrorMemoryAllocation";
        case cudaErrorInvalidConfiguration:
            return "cudaErrorInvalidConfiguration";
        case cudaErrorInvalidMemcpyDirection:
            return "cudaErrorInvalidMemcpyDirection";
        case cudaErrorInvalidResourceHandle:
            return "cudaErrorInvalidResourceHandle";
        case cudaErrorStreamCaptureUnsupported:
            return "cudaErrorStreamCaptureUnsupported";
        case cudaErrorStreamCaptureInvalidated:
            return "cudaErrorStreamCaptureInvalidated";
        case cudaErrorStreamCaptureImplicit:
            return "cudaErrorStreamCaptureImplicit";
        default:
            return "cudaErrorUnknown";
    }
}

const char* cudaGetErrorString(cudaError_t error) {
    switch (error) {
        case cudaSuccess:
            return "no error";
        case cudaErrorInvalidValue:
            return "invalid argument";
        case cudaErrorMemoryAllocation:
            return "out of memory";
        case cudaErrorInvalidConfiguration:
            return "invalid configuration argument";
        case cudaErrorInvalidMemcpyDirection:
            return "invalid copy direction for memcpy";
        case cudaErrorInvalidResourceHandle:
            return "invalid resource handle";
        case cudaErrorStreamCaptureUnsupported:
            return "operation not permitted when stream is capturing";
        case cudaErrorStreamCaptureInvalidated:
            return "operation failed due to a previous error during capture";
        case cudaErrorStreamCaptureImplicit:
            return "operation would make the legacy stream depend on a capturing blocking stream";
        default:
            return "unknown error";
    }
}

// ---- device
// ----------------------------------------------------------------------------------------
cudaError_t cudaGetDeviceCount(int* count) {
    *count = 1;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    return device == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice);
}

cudaError_t cudaDeviceSynchronize(void) {
    if (cudaError_t e = cudasim::check_not_capturing()) return e;
    cudasim::complete_all();
    return cudaSuccess;
}

cudaError_t cudaDeviceReset(void) {
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* v) {
    *v = 13000;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* v) {
    *v = 13000;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
    if (device != 0) return fail(cudaErrorInvalidDevice);
    std::memset(prop, 0, sizeof(*prop));
    std::snprintf(prop->name, sizeof(prop->name), "memtrain CUDA simulator (sm_90)");
    prop->totalGlobalMem = cudasim::device_bytes();
    prop->sharedMemPerBlock = 48 * 1024;
    prop->sharedMemPerBlockOptin = 227 * 1024;
    prop->sharedMemPerMultiprocessor = 228 * 1024;
    prop->regsPerBlock = 65536;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->maxThreadsDim[0] = 1024;
    prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 0x7FFFFFFF;
    prop->maxGridSize[1] = 65535;
    prop->maxGridSize[2] = 65535;
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = 132;
    prop->l2CacheSize = 50 * 1024 * 1024;
    prop->maxThreadsPerMultiProcessor = 2048;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
    if (device != 0) return fail(cudaErrorInvalidDevice);
    switch (attr) {
        case cudaDevAttrMultiProcessorCount:
            *value = 132;
            return cudaSuccess;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin:
            *value = 227 * 1024;
            return cudaSuccess;
        case cudaDevAttrMaxSharedMemoryPerBlock:
            *value = 48 * 1024;
            return cudaSuccess;
        case cudaDevAttrComputeCapabilityMajor:
            *value = 9;
            return cudaSuccess;
        case cudaDevAttrComputeCapabilityMinor:
            *value = 0;
            return cudaSuccess;
        case cudaDevAttrMaxThreadsPerBlock:
            *value = 1024;
            return cudaSuccess;
        case cudaDevAttrWarpSize:
            *value = 32;
            return cudaSuccess;
        case cudaDevAttrL2CacheSize:
            *value = 50 * 1024 * 1024;
            return cudaSuccess;
        default:
            *value = 0;
            return cudaSuccess;
    }
}

cudaError_t cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
    if (!func) return fail(cudaErrorInvalidDeviceFunction);
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize && value > 227 * 1024)
        return fail(cudaErrorInvalidValue);
    return cudaSuccess;
}

// ---- memory
// ----------------------------------------------------------------------------------------
cudaError_t cudaMalloc(void** ptr, size_t size) {
    if (cudasim::check_not_capturing() != cudaSuccess) return cudaErrorStreamCaptureImplicit;
    auto& st = state();
    std::lock_guard lock(st.mu);
    const std::size_t bytes = size == 0 ? 1 : (size + 255) / 256 * 256;
    if (st.used + bytes > cudasim::device_bytes()) {
        *ptr = nullptr;
        return fail(cudaErrorMemoryAllocation);
    }
    // Exactly `size` bytes (256-byte aligned, as cudaMalloc's), so AddressSanitizer reports a
    // kernel that touches the bytes past them.
    void* p = nullptr;
    if (posix_memalign(&p, 256, size == 0 ? 1 : size) != 0) return fail(cudaErrorMemoryAllocation);
    std::memset(p, 0xFF, size == 0 ? 1 : size);  // starts undefined: NaN in every float type
    st.device[reinterpret_cast<uintptr_t>(p)] = size;
    st.used += bytes;
    *ptr = p;
    return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
    if (!ptr) return cudaSuccess;
    // cudaFree waits for the device to finish the work queued before it (an implicit
    // cudaDeviceSynchronize), so no queued kernel reads freed memory.
    cudasim::complete_all();
    auto& st = state();
    std::lock_guard lock(st.mu);
    auto it = st.device.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == st.device.end()) return fail(cudaErrorInvalidValue);
    st.used -= it->second == 0 ? 256 : (it->second + 255) / 256 * 256;
    st.device.erase(it);
    std::free(ptr);
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
    auto& st = state();
    std::lock_guard lock(st.mu);
    *total = cudasim::device_bytes();
    *free_bytes = *total - st.used;
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
    void* p = std::aligned_alloc(4096, (size + 4095) / 4096 * 4096 + (size == 0 ? 4096 : 0));
    if (!p) return fail(cudaErrorMemoryAllocation);
    auto& st = state();
    std::lock_guard lock(st.mu);
    st.pinned[reinterpret_cast<uintptr_t>(p)] = size;
    *ptr = p;
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int) {
    return cudaMallocHost(ptr, size);
}

cudaError_t cudaFreeHost(void* ptr) {
    if (!ptr) return cudaSuccess;
    cudasim::complete_all();  // as cudaFree: a queued copy may still read or write it
    auto& st = state();
    std::lock_guard lock(st.mu);
    auto it = st.pinned.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == st.pinned.end()) return fail(cudaErrorInvalidValue);
    st.pinned.erase(it);
    std::free(ptr);
    return cudaSuccess;
}

cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int) {
    auto& st = state();
    std::lock_guard lock(st.mu);
    st.pinned[reinterpret_cast<uintptr_t>(ptr)] = size;
    return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* ptr) {
    cudasim::complete_all();
    auto& st = state();
    std::lock_guard lock(st.mu);
    return st.pinned.erase(reinterpret_cast<uintptr_t>(ptr)) ? cudaSuccess
                                                             : fail(cudaErrorInvalidValue);
}

// A synchronous copy is queued on the legacy stream (so it waits for the legacy and blocking
// streams' earlier work, never for a non-blocking stream's) and returns once it has run.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
    if (cudasim::check_not_capturing() != cudaSuccess) return cudaErrorStreamCaptureImplicit;
    if (cudaError_t e = cudasim::check_copy(dst, src, count, kind)) return fail(e);
    if (count == 0) return cudaSuccess;
    cudasim::Lock lock;
    auto item = std::make_shared<cudasim::Item>();
    item->run = [=] { std::memmove(dst, src, count); };
    cudasim::complete(cudasim::push(cudasim::stream_of(nullptr), item));
    return cudaSuccess;
}

// As CUDA's: from pinned memory, or between device buffers, the copy reads and writes when the
// stream reaches it; from pageable memory to the device, the host buffer is read now (CUDA
// stages it before returning); from the device to pageable memory, the call returns once the
// copy has run.
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
    if (cudaError_t e = cudasim::check_copy(dst, src, count, kind)) return fail(e);
    cudasim::Lock lock;
    CUstream_st* s = cudasim::stream_of(stream);
    const void* host = kind == cudaMemcpyHostToDevice   ? src
                       : kind == cudaMemcpyDeviceToHost ? static_cast<const void*>(dst)
                                                        : nullptr;
    const bool pageable = host && count > 0 && !cudasim::is_pinned(host, count);
    if (s->capturing && pageable) {
        // A captured copy from or to pageable host memory is not allowed (the graph would read
        // the host buffer at replay, when the caller may have changed it).
        s->invalidated = true;
        return fail(cudaErrorStreamCaptureUnsupported);
    }
    if (count == 0) return cudaSuccess;
    if (s->capturing || !pageable)
        return cudasim::enqueue(stream, [=] { std::memmove(dst, src, count); });
    auto item = std::make_shared<cudasim::Item>();
    if (kind == cudaMemcpyHostToDevice) {
        auto staged = std::make_shared<std::vector<unsigned char>>(
            static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + count);
        item->run = [=] { std::memcpy(dst, staged->data(), count); };
        cudasim::push(s, item);
    } else {
        item->run = [=] { std::memmove(dst, src, count); };
        cudasim::complete(cudasim::push(s, item));
    }
    return cudaSuccess;
}

// cudaMemset on device memory is asynchronous to the host: queued on the legacy stream.
cudaError_t cudaMemset(void* ptr, int value, size_t count) {
    if (cudasim::check_not_capturing() != cudaSuccess) return cudaErrorStreamCaptureImplicit;
    if (count && !cudasim::is_device(ptr, count)) return fail(cudaErrorInvalidValue);
    if (count == 0) return cudaSuccess;
    return cudasim::enqueue(nullptr, [=] { std::memset(ptr, value, count); });
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
    if (count && !cudasim::is_device(ptr, count)) return fail(cudaErrorInvalidValue);
    if (count == 0) return cudaSuccess;
    return cudasim::enqueue(stream, [=] { std::memset(ptr, value, count); });
}

// ---- streams and events
// ----------------------------------------------------------------------------
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
    *stream = cudasim::new_stream(true);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
    *stream = cudasim::new_stream((flags & cudaStreamNonBlocking) == 0);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    if (!stream || stream == cudaStreamLegacy || stream == cudaStreamPerThread)
        return fail(cudaErrorInvalidResourceHandle);
    cudasim::destroy_stream(stream);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    cudasim::Lock lock;
    CUstream_st* s = cudasim::stream_of(stream);
    if (s->capturing) {
        s->invalidated = true;
        return fail(cudaErrorStreamCaptureUnsupported);
    }
    if (cudaError_t e = cudasim::check_not_capturing()) return e;
    if (s->legacy)
        cudasim::complete_legacy();
    else
        cudasim::complete(s->tail);
    return cudaSuccess;
}

// A query makes progress (a GPU would have, meanwhile) without waiting for another process.
cudaError_t cudaStreamQuery(cudaStream_t stream) {
    cudasim::Lock lock;
    CUstream_st* s = cudasim::stream_of(stream);
    return cudasim::complete(s->tail, false) ? cudaSuccess : cudaErrorNotReady;
}

// Later work on `stream` waits for the event's last record made before this call; an event
// never recorded makes no wait.
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
    if (!event) return fail(cudaErrorInvalidResourceHandle);
    if (cudasim::drop_wait(__builtin_return_address(0))) return cudaSuccess;
    cudasim::Lock lock;
    CUstream_st* s = cudasim::stream_of(stream);
    if (s->capturing || !event->record || event->record->state == cudasim::Item::State::Done)
        return cudaSuccess;
    auto item = std::make_shared<cudasim::Item>();
    item->after_done.push_back(event->record);
    cudasim::push(s, std::move(item));
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
    *event = new CUevent_st;
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
    return cudaEventCreate(event);
}

// A record still queued completes later, as on a GPU; the waits made on it keep it.
cudaError_t cudaEventDestroy(cudaEvent_t event) {
    if (!event) return fail(cudaErrorInvalidResourceHandle);
    cudasim::Lock lock;
    delete event;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    if (!event) return fail(cudaErrorInvalidResourceHandle);
    cudasim::Lock lock;
    CUstream_st* s = cudasim::stream_of(stream);
    if (s->capturing) return cudaSuccess;  // a captured record orders nothing in this simulator
    event->record = cudasim::push(s, std::make_shared<cudasim::Item>());
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
    if (!event) return fail(cudaErrorInvalidResourceHandle);
    cudasim::Lock lock;
    return cudasim::complete(event->record, false) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    if (!event) return fail(cudaErrorInvalidResourceHandle);
    if (cudaError_t e = cudasim::check_not_capturing()) return e;
    cudasim::Lock lock;
    cudasim::complete(event->record);
    return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    if (!start || !end || !start->record || !end->record)
        return fail(cudaErrorInvalidResourceHandle);
    cudasim::Lock lock;
    if (start->record->state != cudasim::Item::State::Done ||
        end->record->state != cudasim::Item::State::Done)
        return fail(cudaErrorNotReady);
    *ms = std::chrono::duration<float, std::milli>(end->record->when - start->record->when).count();
    return cudaSuccess;
}

// ---- graphs
// ----------------------------------------------------------------------------------------
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode) {
    if (!stream || stream == cudaStreamLegacy) return fail(cudaErrorStreamCaptureUnsupported);
    CUstream_st* s = cudasim::stream_of(stream);
    if (s->capturing) return fail(cudaErrorIllegalState);
    s->capturing = true;
    s->invalidated = false;
    s->recorded.clear();
    std::lock_guard lock(state().mu);
    state().capturing.push_back(s);
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
    CUstream_st* s = cudasim::stream_of(stream);
    if (!s->capturing) return fail(cudaErrorIllegalState);
    s->capturing = false;
    {
        auto& st = state();
        std::lock_guard lock(st.mu);
        st.capturing.erase(std::find(st.capturing.begin(), st.capturing.end(), s));
    }
    if (s->invalidated) {
        s->recorded.clear();
        *graph = nullptr;
        return fail(cudaErrorStreamCaptureInvalidated);
    }
    *graph = new CUgraph_st{std::move(s->recorded)};
    s->recorded.clear();
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* status) {
    CUstream_st* s = cudasim::stream_of(stream);
    *status = !s->capturing    ? cudaStreamCaptureStatusNone
              : s->invalidated ? cudaStreamCaptureStatusInvalidated
                               : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
    if (!graph) return fail(cudaErrorInvalidValue);
    *exec =
        new CUgraphExec_st{std::make_shared<const std::vector<std::function<void()>>>(graph->work)};
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
    if (!exec) return fail(cudaErrorInvalidValue);
    return cudasim::enqueue(stream, [work = exec->work] {
        for (auto& w : *work) w();
    });
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    delete exec;
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    delete graph;
    return cudaSuccess;
}

}  // extern "C"
