# memtrain: the two commands of the README.
#   make demo   install dependencies, build what the demo runs, train the demo GPT on real English
#               text
#   make test   install dependencies, build everything, run every test
BUILD ?= build
JOBS ?= $(shell nproc)
MEMTRAIN = $(BUILD)/memtrain
FORTUNES = /usr/share/games/fortunes
DEMO_DATA = data/fortunes
# Whether a GPU answers here: then the demo builds the CUDA backend it will load (nvcc), else the
# command line alone (a CPU run never loads the backend: docs/cuda.md, "Build").
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)

.PHONY: all deps configure build demo-build demo test bench gpu-bundle clean format

all: build

# `make demo` installs what the demo builds and runs; everything else (the tests' PyTorch,
# Chromium, GPT-2's tokenizer files) comes with `make test` (scripts/deps.sh).
DEPS_SET ?= all
demo demo-build: DEPS_SET = demo
# The demo configures nvcc only where a GPU answers (CMake's CUDA checks cost ~15 s); the tests
# build the GPU targets everywhere.
CUDA_GPU ?= ON
demo demo-build: CUDA_GPU = $(if $(GPU),ON,OFF)

deps:
	@bash scripts/deps.sh $(DEPS_SET)

configure: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DMEMTRAIN_CUDA_GPU=$(CUDA_GPU) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

demo-build: configure
	@cmake --build $(BUILD) -j $(JOBS) --target memtrain $(if $(GPU),memtrain_cuda)

# The demo corpus: Debian's fortune databases (the .dat files are indexes; .u8 are symlinks).
$(DEMO_DATA)/train.bin: | demo-build
	@mkdir -p $(DEMO_DATA)
	$(MEMTRAIN) tokenizer train --vocab-size 4096 --doc-separator % --out $(DEMO_DATA)/tokenizer.json \
	    $$(find $(FORTUNES) -maxdepth 1 -type f ! -name '*.dat' | sort)
	$(MEMTRAIN) tokenize --tokenizer $(DEMO_DATA)/tokenizer.json --out $(DEMO_DATA) --doc-separator % \
	    --val-fraction 0.05 $$(find $(FORTUNES) -maxdepth 1 -type f ! -name '*.dat' | sort)

# --overwrite: each `make demo` replaces the previous demo run in out/demo (a plain
# `memtrain train` refuses an out_dir that holds another run: docs/training.md, "The out_dir").
demo: demo-build $(DEMO_DATA)/train.bin
	$(MEMTRAIN) train configs/demo.toml --overwrite

test: build
	@bash scripts/run_tests.sh $(BUILD)

bench: build
	@bash bench/cpu.sh $(BUILD)

# The GPU machine's bundle (docs/benchmarks.md, "GPU"): built here, carried there.
gpu-bundle: deps
	@bash scripts/gpu_bundle.sh $(BUILD)

format:
	@clang-format -i $$(git ls-files '*.cpp' '*.h')

clean:
	rm -rf $(BUILD) data out
