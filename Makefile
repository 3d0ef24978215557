# The front door: `make demo` and `make test` set up, build and run on a fresh machine.
# Builds are incremental (CMake + Ninja): running a target twice rebuilds nothing that
# did not change.

BUILD ?= build
CUDA ?= AUTO
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all setup build demo test sanitize cuda-check fuzz clean

all: build

setup:
	@bash scripts/setup.sh

$(BUILD)/build.ninja: | setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=$(CUDA) $(CMAKE_FLAGS)

build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	bash scripts/demo.sh $(BUILD)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The CPU suite under AddressSanitizer + UndefinedBehaviorSanitizer.
sanitize: setup
	cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTESSERA_CUDA=OFF \
	  -DTESSERA_ASAN=ON -DTESSERA_UBSAN=ON
	cmake --build build-sanitize -j $(JOBS)
	cd build-sanitize && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS) -L cpu

# libFuzzer targets (fuzz/: config parser, safetensors reader, dataset index reader) built
# with clang + ASan + UBSan, each run for FUZZ_SECONDS. Needs clang (scripts/setup.sh
# installs it when FUZZ=1).
FUZZ_SECONDS ?= 30
fuzz:
	FUZZ=1 bash scripts/setup.sh
	cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
	  -DCMAKE_CXX_COMPILER=clang++ -DTESSERA_CUDA=OFF -DTESSERA_BUILD_TESTS=OFF -DTESSERA_ASAN=ON \
	  -DTESSERA_UBSAN=ON -DTESSERA_FUZZ=ON
	cmake --build build-fuzz -j $(JOBS) --target fuzz_config fuzz_safetensors fuzz_indexed_dataset
	bash fuzz/run.sh build-fuzz $(FUZZ_SECONDS)

# Configures and compiles the CUDA backend (needs nvcc; runs nothing on a GPU).
cuda-check: setup
	cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON -DTESSERA_BUILD_TESTS=ON
	cmake --build build-cuda -j $(JOBS)

clean:
	rm -rf $(BUILD) build-sanitize build-cuda build-fuzz
