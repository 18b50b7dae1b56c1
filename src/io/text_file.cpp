// Text file helpers (see text_file.h).
#include "io/text_file.h"

#include <fstream>
#include <sstream>

#include "core/error.h"

namespace fs = std::filesystem;

namespace memtrain::io {

std::string read_text_file(const fs::path& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) fail("could not read {}", path.string());
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

void write_text_file(const fs::path& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f << text;
    f.close();
    if (!f) fail("could not write {}", path.string());
}

void write_text_file_atomically(const fs::path& path, const std::string& text) {
    fs::path tmp = path;
    tmp += ".tmp";
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
}

}  // namespace memtrain::io
