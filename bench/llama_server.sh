#!/usr/bin/env bash
# Build llama.cpp's llama-server, the peer of bench/same_answer.py and bench/extract_jobs.py, from the
# llama-cpp-python sdist on PyPI (its vendor/llama.cpp; no model hub, no git needed), and print its path.
#
#   bench/llama_server.sh [native|avx2] [DIR]     # default: native, /tmp/llama-server
#
# native: GGML_NATIVE (-march=native: its AVX-512 / VNNI kernels where the CPU has them), except on a
#   CPU that lists AMX, where the AVX-512 options are named one by one and AMX left off (a VM can list
#   AMX and fault on its tiles; the llama-server of docs/benchmarks.md's Xeon runs was built so).
# avx2: every AVX-512, VNNI and AMX option off: the peer of `make test-avx2`'s path on a CPU that has more.
# Exits non-zero with pip's message, or the end of cmake's log, on failure. Took 5-6 minutes on 2 cores.
set -euo pipefail
mode=${1-native}
dir=${2:-/tmp/llama-server}
version=0.3.36
case $mode in
  native | avx2) ;;
  *) echo "usage: $0 [native|avx2] [DIR]" >&2; exit 2 ;;
esac
src=$dir/llama_cpp_python-$version/vendor/llama.cpp
if [ ! -f "$dir/.extracted-$version" ]; then  # an interrupted extraction is redone, not built from
  mkdir -p "$dir"
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dir" -q
  rm -rf "$dir/llama_cpp_python-$version"
  tar -xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
  touch "$dir/.extracted-$version"
fi
flags=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_SERVER=ON -DGGML_OPENMP=ON)
off=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
on=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
has() { grep -qw "$1" /proc/cpuinfo; }
if [ "$mode" = avx2 ]; then
  flags+=("${on[@]}" "${off[@]}" -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
    -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF)
elif has amx_tile; then
  flags+=("${on[@]}" "${off[@]}")
  for f in avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx512vbmi:AVX512_VBMI \
    avx_vnni:AVX_VNNI; do
    if has "${f%%:*}"; then flags+=("-DGGML_${f#*:}=ON"); else flags+=("-DGGML_${f#*:}=OFF"); fi
  done
else
  flags+=(-DGGML_NATIVE=ON)
fi
build=$src/build-$mode
log() { echo "$0: $1 failed; the last lines of $2:" >&2; tail -n 30 "$2" >&2; exit 1; }
cmake -S "$src" -B "$build" "${flags[@]}" >"$dir/cmake-$mode.log" 2>&1 || log "cmake" "$dir/cmake-$mode.log"
cmake --build "$build" --target llama-server -j "$(nproc)" >"$dir/build-$mode.log" 2>&1 ||
  log "the build" "$dir/build-$mode.log"
echo "$build/bin/llama-server"
