# memtrain: the two commands of the README.
#   make demo   install dependencies, build, train the demo GPT on real English text
#   make test   install dependencies, build, run every test
BUILD ?= build
JOBS ?= $(shell nproc)
MEMTRAIN = $(BUILD)/memtrain
FORTUNES = /usr/share/games/fortunes
DEMO_DATA = data/fortunes

.PHONY: all deps build demo test bench clean format

all: build

deps:
	@bash scripts/deps.sh

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

# The demo corpus: Debian's fortune databases (the .dat files are indexes; .u8 are symlinks).
$(DEMO_DATA)/train.bin: | build
	@mkdir -p $(DEMO_DATA)
	$(MEMTRAIN) tokenizer train --vocab-size 4096 --doc-separator % --out $(DEMO_DATA)/tokenizer.json \
	    $$(find $(FORTUNES) -maxdepth 1 -type f ! -name '*.dat' | sort)
	$(MEMTRAIN) tokenize --tokenizer $(DEMO_DATA)/tokenizer.json --out $(DEMO_DATA) --doc-separator % \
	    --val-fraction 0.05 $$(find $(FORTUNES) -maxdepth 1 -type f ! -name '*.dat' | sort)

# --overwrite: each `make demo` replaces the previous demo run in out/demo (a plain
# `memtrain train` refuses an out_dir that holds another run: docs/training.md, "The out_dir").
demo: build $(DEMO_DATA)/train.bin
	$(MEMTRAIN) train configs/demo.toml --overwrite

test: build
	@bash scripts/run_tests.sh $(BUILD)

bench: build
	@bash bench/cpu.sh $(BUILD)

format:
	@clang-format -i $$(git ls-files '*.cpp' '*.h')

clean:
	rm -rf $(BUILD) data out
