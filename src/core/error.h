// memtrain::Error: the one exception type for bad input and impossible requests.
// Its message is meant for a person: it names the file, key or argument, what was found and what
// was expected. The CLI prints it on one line and exits non-zero.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace memtrain {

class Error : public std::runtime_error {
  public:
    explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws memtrain::Error with an fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
    throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace memtrain
