// The metrics log (see metrics_log.h).
#include "io/metrics_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain::io {

namespace {

// Where the last complete line of fd ends (the offset after its '\n'), 0 if none.
off_t end_of_last_line(int fd, off_t size) {
    std::vector<char> buf(1 << 16);
    off_t at = size;
    while (at > 0) {
        const off_t from = at > (off_t)buf.size() ? at - (off_t)buf.size() : 0;
        const ssize_t n = ::pread(fd, buf.data(), (std::size_t)(at - from), from);
        if (n <= 0) return -1;
        for (ssize_t i = n - 1; i >= 0; i--)
            if (buf[(std::size_t)i] == '\n') return from + i + 1;
        at = from;
    }
    return 0;
}

}  // namespace

MetricsLog::MetricsLog(const std::string& path, bool append) : path_(path) {
    // (Read access too: appending first reads the end of the file to find its last line.)
    fd_ = ::open(path.c_str(),
                 O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | (append ? O_APPEND : O_TRUNC), 0644);
    if (fd_ < 0) fail("could not open metrics file {}: {}", path, std::strerror(errno));
    struct stat st;
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd_);
        fd_ = -1;
        fail("metrics file {} is not a regular file", path);
    }
    if (!append || st.st_size == 0) return;
    char last = 0;
    if (::pread(fd_, &last, 1, st.st_size - 1) == 1 && last == '\n') return;
    // A torn last record: cut it, so the appended lines each stay a line of their own.
    const off_t keep = end_of_last_line(fd_, st.st_size);
    if (keep >= 0 && ::ftruncate(fd_, keep) == 0)
        note_ = fmt::format(
            "{} ended in an incomplete line ({} bytes, from a run stopped while writing it); "
            "it was cut off before appending",
            path, (long long)(st.st_size - keep));
    else
        fail("metrics file {} ends in an incomplete line that cannot be cut off: {}", path,
             std::strerror(errno));
}

MetricsLog::~MetricsLog() {
    if (fd_ >= 0) ::close(fd_);
}

bool MetricsLog::write(const std::string& line) {
    if (fd_ < 0 || failed()) return false;
    const std::string text = line + "\n";
    struct stat st;
    const off_t before = ::fstat(fd_, &st) == 0 ? st.st_size : -1;
    const ssize_t w = ::write(fd_, text.data(), text.size());
    if (w == (ssize_t)text.size()) return true;
    const int err = w < 0 ? errno : ENOSPC;  // a short write: the disk filled up in the middle
    // Undo the part that made it, so the file ends in a complete line.
    if (before >= 0 && ::ftruncate(fd_, before) != 0) {
        // (Then the report skips the torn last line, and says so.)
    }
    error_ = fmt::format("cannot write {}: {}", path_, std::strerror(err));
    return false;
}

}  // namespace memtrain::io
