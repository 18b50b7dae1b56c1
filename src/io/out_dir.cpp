// The out_dir's lock and its run files (see out_dir.h).
#include "io/out_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/regular_file.h"

namespace fs = std::filesystem;

namespace memtrain::io {

namespace {

std::string host_name() {
    char buf[256] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
    return buf;
}

bool starts_with(const std::string& s, const char* prefix) {
    return s.rfind(prefix, 0) == 0;
}

// The host a lock holder wrote into the lock file ("pid host\n"), or "".
std::string holder_host(int fd) {
    char buf[300] = {};
    const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return "";
    std::string s(buf, (std::size_t)n);
    const auto sp = s.find(' '), nl = s.find('\n');
    if (sp == std::string::npos || nl == std::string::npos || nl < sp) return "";
    return s.substr(sp + 1, nl - sp - 1);
}

}  // namespace

namespace {

// The lock files this process holds: (device, inode) -> descriptor and holders.
struct HeldLock {
    int fd;
    int holders;
    pid_t pid;  // a child made by fork inherits this table, not the locks: not its entries
};
std::mutex g_locks_mutex;
std::map<std::pair<unsigned long long, unsigned long long>, HeldLock>& held_locks() {
    static std::map<std::pair<unsigned long long, unsigned long long>, HeldLock> m;
    return m;
}

}  // namespace

OutDirLock::OutDirLock(const std::string& out_dir) {
    const std::string path = (fs::path(out_dir) / ".lock").string();
    std::lock_guard<std::mutex> guard(g_locks_mutex);
    struct stat st;
    // Held by this process already: share it, without opening the file again (closing any
    // descriptor of it would drop the process's lock).
    if (::lstat(path.c_str(), &st) == 0) {
        auto it = held_locks().find({st.st_dev, st.st_ino});
        if (it != held_locks().end() && it->second.pid != ::getpid()) {
            held_locks().erase(it);  // (the parent's descriptor stays open in this child)
            it = held_locks().end();
        }
        if (it != held_locks().end()) {
            it->second.holders++;
            held_ = true, dev_ = st.st_dev, ino_ = st.st_ino;
            return;
        }
    }
    // O_NOFOLLOW: a symlink planted as .lock must not make us write elsewhere.
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
        fail("io.out_dir = \"{}\": cannot create its lock file {}: {}", out_dir, path,
             std::strerror(errno));
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        fail("io.out_dir = \"{}\": its lock file {} is not a regular file", out_dir, path);
    }
    const std::pair<unsigned long long, unsigned long long> key{st.st_dev, st.st_ino};
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    if (::fcntl(fd, F_SETLK, &fl) != 0) {
        const int err = errno;
        if (err == EACCES || err == EAGAIN) {
            struct flock who {};
            who.l_type = F_WRLCK;
            who.l_whence = SEEK_SET;
            const long pid =
                ::fcntl(fd, F_GETLK, &who) == 0 && who.l_type != F_UNLCK ? (long)who.l_pid : 0;
            const std::string host = holder_host(fd);
            ::close(fd);
            fail(
                "io.out_dir = \"{}\" is in use by pid {}{}: another memtrain run writes there. "
                "Wait for it to end, or give this run another io.out_dir",
                out_dir, pid > 0 ? std::to_string(pid) : std::string("?"),
                host.empty() || host == host_name() ? std::string() : " on " + host);
        }
        ::close(fd);
        // (NFS without a lock daemon, for one: the run goes on, without the guard.)
        std::fprintf(stderr,
                     "memtrain: warning: io.out_dir = \"%s\": cannot lock %s (%s); nothing stops "
                     "a second run from writing there at the same time\n",
                     out_dir.c_str(), path.c_str(), std::strerror(err));
        return;
    }
    // For a person looking at the directory; the lock itself is what counts.
    const std::string who = fmt::format("{} {}\n", ::getpid(), host_name());
    if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, who.data(), who.size(), 0);
    held_locks()[key] = {fd, 1, ::getpid()};
    held_ = true, dev_ = key.first, ino_ = key.second;
}

void OutDirLock::release() {
    if (!held_) return;
    held_ = false;
    std::lock_guard<std::mutex> guard(g_locks_mutex);
    auto it = held_locks().find({dev_, ino_});
    if (it == held_locks().end() || it->second.pid != ::getpid()) return;
    if (--it->second.holders == 0) {
        ::close(it->second.fd);  // releases the lock
        held_locks().erase(it);
    }
}

OutDirLock::~OutDirLock() {
    release();
}

OutDirLock::OutDirLock(OutDirLock&& other) noexcept
    : held_(std::exchange(other.held_, false)), dev_(other.dev_), ino_(other.ino_) {}

OutDirLock& OutDirLock::operator=(OutDirLock&& other) noexcept {
    if (this != &other) {
        release();
        held_ = std::exchange(other.held_, false);
        dev_ = other.dev_;
        ino_ = other.ino_;
    }
    return *this;
}

bool is_checkpoint_name(const std::string& name) {
    if (!starts_with(name, "ckpt_") || name.size() == 5) return false;
    for (std::size_t i = 5; i < name.size(); i++)
        if (name[i] < '0' || name[i] > '9') return false;
    return true;
}

std::string run_evidence(const std::string& out_dir, const std::string& metrics_name) {
    std::error_code ec;
    const fs::path dir(out_dir);
    if (fs::exists(fs::symlink_status(dir / "latest", ec))) return "latest";
    std::string ckpt;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
        const std::string name = e.path().filename().string();
        if (is_checkpoint_name(name) && (ckpt.empty() || name < ckpt)) ckpt = name;
    }
    if (!ckpt.empty()) return ckpt;
    if (!metrics_name.empty() && fs::file_size(dir / metrics_name, ec) > 0 && !ec)
        return metrics_name;
    return "";
}

void clear_run(const std::string& out_dir, const std::string& metrics_name) {
    const fs::path dir(out_dir);
    std::error_code ec;
    std::vector<fs::path> doomed;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
        const std::string name = e.path().filename().string();
        if (is_checkpoint_name(name) || starts_with(name, ".ckpt_") ||
            starts_with(name, ".latest."))
            doomed.push_back(e.path());
    }
    // `latest` first: a crash in the middle leaves no pointer to a removed checkpoint.
    for (const char* f : {"latest", "memory.json"}) fs::remove(dir / f, ec);
    if (!metrics_name.empty()) fs::remove(dir / metrics_name, ec);
    for (const auto& p : doomed) {
        fs::remove_all(p, ec);
        if (ec) fail("--overwrite: cannot remove {}: {}", p.string(), ec.message());
    }
}

void remove_stale_temporaries(const std::string& out_dir) {
    std::error_code ec;
    std::vector<fs::path> stale;
    for (const auto& e : fs::directory_iterator(fs::path(out_dir), ec)) {
        const std::string name = e.path().filename().string();
        if ((starts_with(name, ".ckpt_") &&
             (name.find(".tmp") != std::string::npos || name.find(".old") != std::string::npos)) ||
            (starts_with(name, ".latest.") && name.ends_with(".tmp")))
            stale.push_back(e.path());
    }
    for (const auto& p : stale) fs::remove_all(p, ec);
}

namespace {

// fsync of every regular file under `dir`, then of each directory: what the writers did not
// sync themselves survives a power cut once the output is in place.
void sync_tree(const fs::path& dir) {
    std::error_code ec;
    for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
        const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) continue;
        ::fsync(fd);
        ::close(fd);
    }
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        ::fsync(fd);
        ::close(fd);
    }
}

void sync_parent(const fs::path& p) {
    const fs::path parent = p.parent_path().empty() ? fs::path(".") : p.parent_path();
    const int fd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        ::fsync(fd);
        ::close(fd);
    }
}

// A fresh, empty directory named prefix + six random characters (mkdtemp).
std::string make_unique_dir(const std::string& prefix) {
    std::string templ = prefix + "XXXXXX";
    if (!::mkdtemp(templ.data()))
        fail("cannot create a directory {}: {}", templ, std::strerror(errno));
    return templ;
}

}  // namespace

StagedDir::StagedDir(const std::string& out, const std::string& marker,
                     const std::string& command) {
    fs::path p = fs::path(out).lexically_normal();
    if (p.filename().empty()) p = p.parent_path();  // "q/" is "q"
    if (p.empty() || p == "." || p == ".." || p == p.root_path())
        fail("--out {}: give a directory to create (or an earlier {} output to replace)", out,
             command);
    out_ = p.string();
    std::error_code ec;
    if (fs::exists(fs::symlink_status(p, ec)) &&
        !(fs::is_directory(fs::symlink_status(p, ec)) && fs::exists(p / marker, ec)))
        fail("--out {} exists and is not a {} output; refusing to replace it", out, command);
    if (!p.parent_path().empty()) fs::create_directories(p.parent_path(), ec);
    stage_ = make_unique_dir(out_ + ".tmp.");
}

StagedDir::~StagedDir() {
    if (committed_) return;
    std::error_code ec;
    fs::remove_all(stage_, ec);
}

void StagedDir::commit() {
    sync_tree(stage_);
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(out_, ec))) {
        if (::rename(stage_.c_str(), out_.c_str()) != 0)
            fail("cannot move {} into place as {}: {}", stage_, out_, std::strerror(errno));
        committed_ = true;
        sync_parent(out_);
        return;
    }
    // One rename that swaps the two: OUT is the new output from here, the staging name holds
    // the old one until it is deleted.
    if (::renameat2(AT_FDCWD, stage_.c_str(), AT_FDCWD, out_.c_str(), RENAME_EXCHANGE) == 0) {
        sync_parent(out_);
        test_pause("replace-output");
        committed_ = true;  // (the staging name now holds the old output)
        fs::remove_all(stage_, ec);
        return;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
        fail("cannot put {} in place of {}: {}", stage_, out_, std::strerror(errno));
    // No exchange on this file system: the old output aside (renamed onto an empty directory of
    // a fresh name), the new one in, the old one deleted. Killed in between, both are on disk.
    const std::string aside = make_unique_dir(out_ + ".old.");
    if (::rename(out_.c_str(), aside.c_str()) != 0) {
        const int err = errno;
        fs::remove(aside, ec);
        fail("cannot move the old {} aside: {}", out_, std::strerror(err));
    }
    test_pause("replace-output-aside");
    if (::rename(stage_.c_str(), out_.c_str()) != 0) {
        const int err = errno;
        (void)!::rename(aside.c_str(), out_.c_str());  // put the old one back
        fail("cannot move {} into place as {}: {}", stage_, out_, std::strerror(err));
    }
    committed_ = true;
    sync_parent(out_);
    fs::remove_all(aside, ec);
}

}  // namespace memtrain::io
