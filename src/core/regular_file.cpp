// Regular-file checks and capped reads (see regular_file.h).
#include "core/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace memtrain {

std::string file_kind(unsigned mode) {
    switch (mode & S_IFMT) {
        case S_IFREG:
            return "a regular file";
        case S_IFDIR:
            return "a directory";
        case S_IFIFO:
            return "a FIFO (named pipe)";
        case S_IFCHR:
            return "a character device";
        case S_IFBLK:
            return "a block device";
        case S_IFSOCK:
            return "a socket";
        default:
            return "not a regular file";
    }
}

int open_regular_file(const std::string& path, const std::string& what) {
    struct stat st;
    // stat follows symlinks: a link to /dev/zero is judged by what it points at.
    if (::stat(path.c_str(), &st) != 0) {
        if (errno == ENOENT) fail("{} {} does not exist", what, path);
        fail("{} {} cannot be read: {}", what, path, std::strerror(errno));
    }
    if (!S_ISREG(st.st_mode))
        fail("{} {} is {}, not a regular file; give a file", what, path, file_kind(st.st_mode));
    // O_NONBLOCK: should the path have become a FIFO since the stat, the open returns at once
    // instead of waiting for a writer, and the fstat below refuses it.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) fail("{} {} cannot be opened: {}", what, path, std::strerror(errno));
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        fail("{} {} is not a regular file; give a file", what, path);
    }
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    return fd;
}

std::string read_regular_file(const std::string& path, std::size_t max_bytes,
                              const std::string& what) {
    const int fd = open_regular_file(path, what);
    struct stat st;
    if (::fstat(fd, &st) == 0 && (uint64_t)st.st_size > max_bytes) {
        ::close(fd);
        fail("{} {} is {} bytes, more than the {} bytes a {} may be", what, path,
             (uint64_t)st.st_size, max_bytes, what);
    }
    std::string out;
    out.reserve((std::size_t)st.st_size);
    char buf[1 << 16];
    for (;;) {
        const ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0) {
            if (errno == EINTR) continue;
            const int saved = errno;
            ::close(fd);
            fail("{} {} cannot be read: {}", what, path, std::strerror(saved));
        }
        if (n == 0) break;
        // The file may grow while it is read: the cap holds for what is read, not the stat.
        if (out.size() + (std::size_t)n > max_bytes) {
            ::close(fd);
            fail("{} {} is more than the {} bytes a {} may be", what, path, max_bytes, what);
        }
        out.append(buf, (std::size_t)n);
    }
    ::close(fd);
    return out;
}

void check_json_nesting(std::string_view text, int max_depth, const std::string& what) {
    int depth = 0;
    bool in_string = false;
    for (std::size_t i = 0; i < text.size(); i++) {
        const char c = text[i];
        if (in_string) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_string = false;
            continue;
        }
        if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            if (++depth > max_depth)
                fail("{} nests arrays or objects more than {} deep (at byte {})", what, max_depth,
                     i);
        } else if (c == ']' || c == '}') {
            depth = depth > 0 ? depth - 1 : 0;
        }
    }
}

void test_pause(const char* point) {
    const char* at = std::getenv("MEMTRAIN_TEST_PAUSE_AT");
    if (!at || std::strcmp(at, point) != 0) return;
    std::fprintf(stderr, "memtrain: test pause at %s\n", point);
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::minutes(10));
}

}  // namespace memtrain
