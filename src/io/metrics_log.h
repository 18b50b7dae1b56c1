// metrics.jsonl as the Trainer writes it: one JSON object a line, each line one write(2), so
// the file only ever ends in a complete line. A write that fails (a full disk, a file-size
// limit) is undone to the last complete line and reported, never left as a torn record.
#pragma once

#include <cstdint>
#include <string>

namespace memtrain::io {

class MetricsLog {
  public:
    MetricsLog() = default;
    // Opens `path` (a plain name inside the out_dir: the caller checked it), new and empty, or
    // with `append` after what is there. Appending starts on a fresh line: an incomplete last
    // line (a run killed mid-write, a full disk) is cut off first, and note() says so. Symlinks
    // are not followed.
    MetricsLog(const std::string& path, bool append);
    ~MetricsLog();
    MetricsLog(const MetricsLog&) = delete;
    MetricsLog& operator=(const MetricsLog&) = delete;

    bool is_open() const { return fd_ >= 0; }
    // Appends `line` and a newline. After a failure nothing more is written; false then, and
    // error() says why (the first time with the step it failed at).
    bool write(const std::string& line);
    bool failed() const { return !error_.empty(); }
    const std::string& error() const { return error_; }
    // What opening for append repaired ("" when nothing).
    const std::string& note() const { return note_; }
    const std::string& path() const { return path_; }

  private:
    int fd_ = -1;
    std::string path_, error_, note_;
};

}  // namespace memtrain::io
