#!/usr/bin/env bash
# Build the llama.cpp peer that benchmarks measure against, from the source the llama-cpp-python
# sdist vendors, into a cache outside the repo (never in CI; ~15 min on 2 cores, then cached).
#
#   tools/build_llama_cpp.sh            # build (or reuse) and print the variables below
#   eval "$(tools/build_llama_cpp.sh)"  # then: $LLAMA_CPP_BIN/llama-quantize, python tools/bench_cpu.py
#
# Prints:  LLAMA_CPP_BIN   llama-quantize llama-bench llama-batched-bench llama-perplexity llama-server
#          LLAMA_CPP_SRC   the source tree (convert_hf_to_gguf.py; run it with PYTHONPATH=$LLAMA_CPP_SRC/gguf-py)
#          LLAMA_CPP_LIB_PATH  the shared libllama that the llama-cpp-python package loads when this
#                          variable is set; the package itself is installed with LLAMA_BUILD=OFF, so
#                          llama.cpp is compiled once for the binaries and the Python binding both.
#
# Why not GGML_NATIVE: on CPUs with AMX (Sapphire Rapids and later Xeons) the native build of
# 0.3.36 segfaults in the AMX path; the instruction sets are chosen here from /proc/cpuinfo,
# AVX-512 (VNNI, BF16) where the CPU has it, AVX2 otherwise, AMX off.
# Environment: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), EDGEINFER_CACHE (default ~/.cache/edgeinfer),
#              PYTHON (the interpreter to install the binding into; default: .venv/bin/python if present).
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
cache="${EDGEINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgeinfer}/llama.cpp/$version"
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$([ -x "$repo/.venv/bin/python" ] && echo "$repo/.venv/bin/python" || echo python3)}"
targets=(llama-quantize llama-bench llama-batched-bench llama-perplexity llama-server)
say() { echo "build_llama_cpp: $*" >&2; }

src="$cache/src"
if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
    mkdir -p "$cache" && tmp="$(mktemp -d "$cache/.download-XXXXXX")"
    say "downloading the llama-cpp-python $version sdist"
    "$python" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$tmp" >&2
    mkdir -p "$tmp/x" && tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp/x"
    rm -rf "$src" && mv "$tmp/x/llama_cpp_python-$version" "$src" && rm -rf "$tmp"
fi

flags=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
cpu="$(grep -m1 '^flags' /proc/cpuinfo || true)"
has() { [[ " $cpu " == *" $1 "* ]] && echo ON || echo OFF; }
flags+=(-DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)"
        -DGGML_BMI2="$(has bmi2)" -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VNNI="$(has avx512_vnni)"
        -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AVX512_VBMI="$(has avx512vbmi)")

build="$cache/build"
stamp="$build/.built-$(echo "${flags[*]}" | sha256sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    say "building ${targets[*]} (about 15 minutes on 2 cores) into $build"
    cmake -S "$src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        "${flags[@]}" >&2
    cmake --build "$build" --target "${targets[@]}" llama -j "$(nproc)" >&2
    touch "$stamp"
fi

if ! "$python" -c "import llama_cpp" 2>/dev/null; then
    say "installing the llama-cpp-python $version binding without its own llama.cpp build"
    CMAKE_ARGS="-DLLAMA_BUILD=OFF" "$python" -m pip install --quiet "$src" >&2
fi

echo "export LLAMA_CPP_BIN=$build/bin"
echo "export LLAMA_CPP_SRC=$src/vendor/llama.cpp"
echo "export LLAMA_CPP_LIB_PATH=$build/bin"
