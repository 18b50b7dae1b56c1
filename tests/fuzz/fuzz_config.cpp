// libFuzzer target for the run-config reader: any text as a TOML config, and as the value of a
// --set override, must parse or give memtrain::Error (never a crash: toml++ recurses per part of
// a dotted key, config/run_config.h's check_toml_text bounds that first). What parses must
// print back as TOML that parses again to the same config. Build with clang (CMake adds
// fuzz_config); the commands are in docs/fuzzing.md.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "config/run_config.h"
#include "core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string text(reinterpret_cast<const char*>(data), size);
    try {
        const memtrain::RunConfig cfg = memtrain::parse_run_config(text, "fuzz.toml", {});
        const std::string printed = memtrain::to_toml(cfg);
        (void)memtrain::format_table(cfg);
        // The printed form is what a checkpoint stores and a resume reads back.
        const memtrain::RunConfig again = memtrain::parse_run_config(printed, "printed", {});
        if (memtrain::to_toml(again) != printed) std::abort();
    } catch (const memtrain::Error&) {
    }
    // The same bytes as a --set value (the override parser wraps it as "v = TEXT").
    try {
        (void)memtrain::parse_run_config("", "fuzz", {"sample.prompt=" + text});
        (void)memtrain::parse_run_config("", "fuzz", {"optim.lr=" + text});
    } catch (const memtrain::Error&) {
    }
    return 0;
}
