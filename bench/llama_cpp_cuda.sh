#!/bin/bash
# Build llama.cpp's llama-bench for CUDA (sm_90) from the tree vendored by the pinned
# llama-cpp-python sdist, on a machine with nvcc (the device machine: nothing to download).
#   here:   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcpp
#           tar -C /tmp/lcpp/llama_cpp_python-0.3.36/vendor -cJf .devcarry/llama_src.tar.xz \
#               --exclude=llama.cpp/models --exclude=llama.cpp/docs ... llama.cpp  (~5 MB)
#   there:  bash bench/llama_cpp_cuda.sh .devcarry/llama_src.tar.xz /tmp/llama   -> /tmp/llama/bin/llama-bench
#           (GGML_NATIVE=OFF: a binary for any x86-64 host, to carry to another machine)
set -euo pipefail
src=$1 dest=$2
mkdir -p "$dest"
tar -C "$dest" -xJf "$src"
cmake -S "$dest/llama.cpp" -B "$dest/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE="${GGML_NATIVE:-ON}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DGGML_CUDA_NCCL=OFF -DBUILD_SHARED_LIBS=OFF > "$dest/cmake.log"
start=$(date +%s)
cmake --build "$dest/build" --target llama-bench -j "$(nproc)" > "$dest/build.log"
mkdir -p "$dest/bin" && cp "$dest/build/bin/llama-bench" "$dest/bin/"
echo "llama-bench built in $(( $(date +%s) - start )) s: $dest/bin/llama-bench"
