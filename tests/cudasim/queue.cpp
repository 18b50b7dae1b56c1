// cudasim's stream scheduler (queue.h): queues, the dependencies CUDA defines between them, and
// the seeded choice of which stream runs next when a synchronisation needs queued work.
#include "cudasim/queue.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>

#include "cudasim/sim.h"

namespace cudasim {

namespace {

struct Scheduler {
    std::recursive_mutex mu;
    CUstream_st legacy;
    std::vector<CUstream_st*> streams;  // live streams, the legacy one first
    uint64_t next_id = 1;
    uint64_t seed = 1;
    std::mt19937_64 rng;
    std::unordered_map<const void*, ItemPtr> order_tail;  // last operation per communicator

    Scheduler() {
        legacy.legacy = true;
        streams.push_back(&legacy);
        if (const char* v = std::getenv("MEMTRAIN_SIM_SEED")) seed = std::strtoull(v, nullptr, 10);
        rng.seed(seed);
    }
};

Scheduler& sched() {
    static Scheduler* s = new Scheduler;  // never destroyed: static destructors still sync
    return *s;
}

bool ready(const Item& it) {
    for (const ItemPtr& d : it.after_done)
        if (d->state != Item::State::Done) return false;
    return !it.after_started || it.after_started->state != Item::State::Pending;
}

void finish(Item& it) {
    it.state = Item::State::Done;
    it.when = std::chrono::steady_clock::now();
    it.after_done.clear();  // a completed item holds nothing alive
    it.after_started.reset();
    it.done = nullptr;
    CUstream_st* s = it.stream;
    if (!s->queue.empty() && s->queue.front().get() == &it) s->queue.pop_front();
}

void run(Item& it) {
    it.state = Item::State::Started;
    if (it.run) {
        auto f = std::move(it.run);
        it.run = nullptr;
        f();
    }
    if (!it.done || it.done()) finish(it);
}

// A new preference order of the streams: the scheduler runs the most preferred stream that can
// run, so a stream may run far ahead of another until a dependency stops it.
void draw_priorities(Scheduler& sc) {
    for (CUstream_st* s : sc.streams) s->priority = sc.rng();
}

// For each stream, the newest of its items that the targets need (its earlier ones with it).
std::unordered_map<CUstream_st*, uint64_t> needed(const std::vector<ItemPtr>& targets) {
    std::unordered_map<CUstream_st*, uint64_t> need;
    std::vector<ItemPtr> work(targets.begin(), targets.end());
    while (!work.empty()) {
        ItemPtr it = std::move(work.back());
        work.pop_back();
        if (!it || it->state == Item::State::Done) continue;
        uint64_t& upto = need[it->stream];
        if (it->id <= upto) continue;
        const uint64_t before = upto;
        upto = it->id;
        for (const ItemPtr& q : it->stream->queue) {
            if (q->id <= before) continue;
            if (q->id > it->id) break;
            for (const ItemPtr& d : q->after_done) work.push_back(d);
            if (q->after_started) work.push_back(q->after_started);
        }
    }
    return need;
}

[[noreturn]] void stuck(const std::unordered_map<CUstream_st*, uint64_t>& need) {
    std::fprintf(stderr, "cudasim: queued work can never run (a dependency cycle):\n");
    for (const auto& [s, upto] : need)
        if (!s->queue.empty())
            std::fprintf(stderr, "  stream %p: next item %llu (%s), needed up to %llu\n",
                         static_cast<void*>(s), (unsigned long long)s->queue.front()->id,
                         s->queue.front()->state == Item::State::Started ? "started" : "pending",
                         (unsigned long long)upto);
    std::abort();
}

bool all_done(const std::vector<ItemPtr>& targets) {
    for (const ItemPtr& t : targets)
        if (t && t->state != Item::State::Done) return false;
    return true;
}

bool run_until(const std::vector<ItemPtr>& targets, bool block) {
    Scheduler& sc = sched();
    std::lock_guard lock(sc.mu);
    if (all_done(targets)) return true;
    auto need = needed(targets);
    bool everything = false;
    draw_priorities(sc);
    for (long spins = 0;;) {
        if (all_done(targets)) return true;
        // Asynchronous work in flight (another process's part of a collective) is polled at
        // every turn, so it completes as soon as the other process allows, and a stream of
        // collectives may run ahead of the compute stream as far as its waits let it.
        bool progressed = false;
        for (CUstream_st* s : sc.streams) {
            if (s->queue.empty()) continue;
            Item& front = *s->queue.front();
            if (front.state == Item::State::Started && front.done()) {
                finish(front);
                progressed = true;
            }
        }
        // The next item of each stream, if the targets need it and its dependencies are met.
        Item* best = nullptr;
        bool started = false;
        for (CUstream_st* s : sc.streams) {
            auto n = need.find(s);
            if (n == need.end() || s->queue.empty()) continue;
            Item& front = *s->queue.front();
            if (front.id > n->second) continue;
            if (front.state == Item::State::Started) {
                started = true;
                continue;
            }
            if (!ready(front)) continue;
            if (!best) {
                best = &front;
            } else if (sc.seed == 0) {
                if (front.id < best->id) best = &front;  // seed 0: the order the host issued
            } else if (s->priority > best->stream->priority) {
                best = &front;
            }
        }
        if (best) {
            run(*best);
            if (sc.seed != 0 && sc.rng() % 8 == 0) draw_priorities(sc);
            spins = 0;
            continue;
        }
        if (progressed) continue;
        if (!started) stuck(need);
        if (!everything) {
            // What is needed waits for another process, which may itself wait for work queued
            // here that nothing here needs yet (a send on another stream): a GPU would run that
            // meanwhile, so from now on everything queued may run.
            everything = true;
            std::vector<ItemPtr> all(targets);
            for (CUstream_st* s : sc.streams) all.push_back(s->tail);
            need = needed(all);
            continue;
        }
        if (!block) return false;
        if (++spins > 1000)
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        else
            std::this_thread::yield();
    }
}

// ---- the wait hook (MEMTRAIN_SIM_DROP_WAIT, MEMTRAIN_SIM_WAIT_SITES) ----------------------------

struct WaitHook {
    std::mutex mu;
    enum class Mode { None, Site, Call } mode = Mode::None;
    uintptr_t value = 0;  // the site's offset in its module, or the call's number (from 1)
    long calls = 0;
    const char* sites_dir = nullptr;
    std::map<std::pair<std::string, uintptr_t>, long> sites;  // (module, offset) -> calls

    WaitHook() {
        if (const char* v = std::getenv("MEMTRAIN_SIM_DROP_WAIT")) {
            if (std::strncmp(v, "site:", 5) == 0) {
                mode = Mode::Site;
                value = std::strtoull(v + 5, nullptr, 0);
            } else if (std::strncmp(v, "call:", 5) == 0) {
                mode = Mode::Call;
                value = std::strtoull(v + 5, nullptr, 0);
            } else if (*v) {
                std::fprintf(stderr,
                             "cudasim: MEMTRAIN_SIM_DROP_WAIT=%s: expected site:OFFSET or "
                             "call:N\n",
                             v);
                std::abort();
            }
        }
        sites_dir = std::getenv("MEMTRAIN_SIM_WAIT_SITES");
        if (sites_dir && *sites_dir) std::atexit(&WaitHook::write_sites);
    }

    static WaitHook& get() {
        static WaitHook* h = new WaitHook;
        return *h;
    }

    // One line per call site: module, offset of the return address, calls.
    static void write_sites() {
        WaitHook& h = get();
        std::lock_guard lock(h.mu);
        const std::string path = std::string(h.sites_dir) + "/waits." + std::to_string(getpid());
        FILE* f = std::fopen(path.c_str(), "w");
        if (!f) return;
        for (const auto& [key, n] : h.sites)
            std::fprintf(f, "%s\t0x%lx\t%ld\n", key.first.c_str(), (unsigned long)key.second, n);
        std::fclose(f);
    }
};

}  // namespace

void lock() {
    sched().mu.lock();
}
void unlock() {
    sched().mu.unlock();
}

CUstream_st* stream_of(cudaStream_t s) {
    if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return &sched().legacy;
    return s;
}

CUstream_st* new_stream(bool blocking) {
    Scheduler& sc = sched();
    std::lock_guard lock(sc.mu);
    auto* s = new CUstream_st;
    s->blocking = blocking;
    s->priority = sc.rng();
    sc.streams.push_back(s);
    return s;
}

void destroy_stream(CUstream_st* s) {
    Scheduler& sc = sched();
    std::lock_guard lock(sc.mu);
    // CUDA lets queued work finish after the destroy; here it finishes before.
    if (s->tail) run_until({s->tail}, true);
    sc.streams.erase(std::find(sc.streams.begin(), sc.streams.end(), s));
    delete s;
}

ItemPtr push(CUstream_st* s, ItemPtr item, const void* order) {
    Scheduler& sc = sched();
    std::lock_guard lock(sc.mu);
    item->id = sc.next_id++;
    item->stream = s;
    auto pending = [](const ItemPtr& p) { return p && p->state != Item::State::Done; };
    if (s->legacy) {
        for (CUstream_st* b : sc.streams)
            if (b->blocking && pending(b->tail)) item->after_done.push_back(b->tail);
    } else if (s->blocking && pending(sc.legacy.tail)) {
        item->after_done.push_back(sc.legacy.tail);
    }
    if (order) {
        ItemPtr& last = sc.order_tail[order];
        if (last && last->state == Item::State::Pending) item->after_started = last;
        last = item;
    }
    s->queue.push_back(item);
    s->tail = item;
    return item;
}

bool complete(const ItemPtr& target, bool block) {
    return run_until({target}, block);
}

void complete_all() {
    Scheduler& sc = sched();
    std::lock_guard lock(sc.mu);
    std::vector<ItemPtr> tails;
    for (CUstream_st* s : sc.streams) tails.push_back(s->tail);
    run_until(tails, true);
}

void complete_legacy() {
    Scheduler& sc = sched();
    std::lock_guard lock(sc.mu);
    std::vector<ItemPtr> tails;
    for (CUstream_st* s : sc.streams)
        if (s->legacy || s->blocking) tails.push_back(s->tail);
    run_until(tails, true);
}

bool drop_wait(const void* site) {
    WaitHook& h = WaitHook::get();
    if (h.mode == WaitHook::Mode::None && !h.sites_dir) return false;
    std::lock_guard lock(h.mu);
    const long call = ++h.calls;
    Dl_info info{};
    uintptr_t offset = reinterpret_cast<uintptr_t>(site);
    std::string module = "?";
    if (dladdr(site, &info) && info.dli_fbase) {
        offset -= reinterpret_cast<uintptr_t>(info.dli_fbase);
        if (info.dli_fname) module = info.dli_fname;
    }
    if (h.sites_dir) h.sites[{module, offset}]++;
    switch (h.mode) {
        case WaitHook::Mode::Site:
            return offset == h.value;
        case WaitHook::Mode::Call:
            return (uintptr_t)call == h.value;
        case WaitHook::Mode::None:
            break;
    }
    return false;
}

// ---- sim.h
// ------------------------------------------------------------------------------------------

cudaError_t enqueue(cudaStream_t stream, std::function<void()> work) {
    Lock lock;
    CUstream_st* s = stream_of(stream);
    if (s->capturing) {
        s->recorded.push_back(std::move(work));
        return cudaSuccess;
    }
    auto item = std::make_shared<Item>();
    item->run = std::move(work);
    push(s, std::move(item));
    return cudaSuccess;
}

cudaError_t enqueue_async(cudaStream_t stream, const void* order, std::function<void()> start,
                          std::function<bool()> done) {
    Lock lock;
    CUstream_st* s = stream_of(stream);
    if (s->capturing) {
        // A graph replays its work in order, each item to completion.
        s->recorded.push_back([start = std::move(start), done = std::move(done)] {
            start();
            while (!done()) std::this_thread::yield();
        });
        return cudaSuccess;
    }
    auto item = std::make_shared<Item>();
    item->run = std::move(start);
    item->done = std::move(done);
    push(s, std::move(item), order);
    return cudaSuccess;
}

void drain() {
    complete_all();
}

uint64_t seed() {
    return sched().seed;
}

void set_seed(uint64_t seed) {
    Scheduler& sc = sched();
    std::lock_guard lock(sc.mu);
    sc.seed = seed;
    sc.rng.seed(seed);
}

}  // namespace cudasim
