// The rules of a training run's output directory (docs/training.md, "The out_dir"): one run
// owns it, held by a lock for the run's life; a new run does not go into a directory that holds
// another run unless told to overwrite it; paths read from files stay inside it.
#pragma once

#include <string>

namespace memtrain::io {

// A lock on OUT_DIR/.lock (a POSIX record lock: released by the kernel when the process ends,
// however it ends; it works on NFS with a lock daemon). A second process that asks for it fails
// at once with "io.out_dir = ... is in use by pid N". Within one process it can be taken again
// (tests run several Trainers in one process): the holders share one descriptor, closed when
// the last lets go (closing any descriptor of the file would drop the process's lock).
class OutDirLock {
  public:
    OutDirLock() = default;
    explicit OutDirLock(const std::string& out_dir);
    ~OutDirLock();
    OutDirLock(OutDirLock&& other) noexcept;
    OutDirLock& operator=(OutDirLock&& other) noexcept;
    OutDirLock(const OutDirLock&) = delete;
    OutDirLock& operator=(const OutDirLock&) = delete;
    bool held() const { return held_; }

  private:
    void release();
    bool held_ = false;
    unsigned long long dev_ = 0, ino_ = 0;  // the lock file's identity in the registry
};

// What in `out_dir` shows that a run has written there: "latest", "ckpt_000010", or the
// metrics file when it is not empty; "" when nothing does.
std::string run_evidence(const std::string& out_dir, const std::string& metrics_name);

// Removes what a run wrote in `out_dir` (latest, every ckpt_* directory and its temporaries,
// the metrics file, memory.json), for a run started with --overwrite. Other files stay.
void clear_run(const std::string& out_dir, const std::string& metrics_name);

// Removes the temporaries of checkpoint saves that died (.ckpt_N.tmp.*, .ckpt_N.old.*,
// .latest.*.tmp): the caller holds the lock, so no live writer owns them.
void remove_stale_temporaries(const std::string& out_dir);

// A directory output (quantize --out, lora merge --out) written under a fresh name beside OUT
// and put in OUT's place in one step, so OUT is always the old output or the new one, whole:
// the two are exchanged by one rename (renameat2 RENAME_EXCHANGE) and the old one deleted
// after; where the file system cannot exchange, the old one is renamed aside, the new one in,
// then the old one deleted. The staging directory is made by mkdtemp (OUT.tmp.XXXXXX): an
// OUT.tmp that memtrain did not make is never touched.
class StagedDir {
  public:
    // `out` as given (a trailing '/' is dropped). An existing OUT without `marker` in it is not
    // an output of `command` and is refused.
    StagedDir(const std::string& out, const std::string& marker, const std::string& command);
    ~StagedDir();  // removes the staging directory unless commit() put it in place
    StagedDir(const StagedDir&) = delete;
    StagedDir& operator=(const StagedDir&) = delete;
    const std::string& dir() const { return stage_; }  // write the output here
    const std::string& out() const { return out_; }
    // fsyncs what was written, puts it in OUT's place, deletes the old output.
    void commit();

  private:
    std::string out_, stage_;
    bool committed_ = false;
};

// Whether `name` is what `latest` may hold: ckpt_ followed by digits, nothing else (no
// directory part, no "..").
bool is_checkpoint_name(const std::string& name);

}  // namespace memtrain::io
