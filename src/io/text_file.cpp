// Text file helpers (see text_file.h).
#include "io/text_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"

namespace fs = std::filesystem;

namespace memtrain::io {

std::string read_text_file(const fs::path& path, std::size_t max_bytes) {
    return read_regular_file(path.string(), max_bytes, "file");
}

void write_text_file(const fs::path& path, const std::string& text) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail("could not write {}: {}", path.string(), std::strerror(errno));
    const char* p = text.data();
    std::size_t left = text.size();
    while (left > 0) {
        const ssize_t w = ::write(fd, p, left);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            const int saved = w < 0 ? errno : ENOSPC;
            ::close(fd);
            fail("could not write {}: {}", path.string(), std::strerror(saved));
        }
        p += w;
        left -= (std::size_t)w;
    }
    if (::fsync(fd) != 0) {
        const int saved = errno;
        ::close(fd);
        fail("could not write {}: {}", path.string(), std::strerror(saved));
    }
    if (::close(fd) != 0) fail("could not write {}: {}", path.string(), std::strerror(errno));
}

void write_text_file_atomically(const fs::path& path, const std::string& text) {
    fs::path tmp = path;
    tmp += fmt::format(".{}.tmp", ::getpid());
    try {
        write_text_file(tmp, text);
    } catch (const Error&) {
        std::error_code ec;
        fs::remove(tmp, ec);
        throw;
    }
    std::error_code ec;
    fs::rename(tmp, path, ec);
    if (ec) {
        fs::remove(tmp, ec);
        fail("could not move {} into place as {}: {}", tmp.string(), path.string(), ec.message());
    }
    sync_directory(path.parent_path());
}

void sync_directory(const fs::path& dir) {
    const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;
    ::fsync(fd);
    ::close(fd);
}

}  // namespace memtrain::io
