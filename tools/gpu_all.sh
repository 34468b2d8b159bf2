#!/usr/bin/env bash
# Everything issue #9 ("the whole engine on one GPU") needs a GPU for, in one device call:
# pytest -m gpu, tools/bench_gemm.py, tools/bench_attention.py and tools/bench_e2e_gpu.py, with
# logs and JSON written into $OUT (8 files at most, the device tool's limit).
#
# Before the call, on the CPU machine (build/ is git-ignored, so it travels only as a carry):
#   .venv/bin/python tools/make_slice.py --force          # build/gpu/slice, 4 layers, 40.5 MiB
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 gguf==0.19.0 websockets==17.4 -d build/gpu/wheels
#   mkdir -p build/gpu/site && cp -r .venv/lib/python3.*/site-packages/llguidance{,-*.dist-info} build/gpu/site/
# The GPU image has torch, triton, transformers, tokenizers, anyio, msgpack, psutil, pytest and
# pytest-xdist but no gguf / websockets / llguidance / bitsandbytes; the wheels above are installed
# offline (--no-index) and llguidance (an abi3 extension; pip here offers no wheel of the version
# the venv holds) goes on PYTHONPATH from build/gpu/site. The bitsandbytes wheel (~60 MB) does not
# fit beside the slice, so the hf-bnb4 rows are skipped. The carry is ~49 MiB of the 64 MiB allowed.
#
# Then the device tool, one call (the tests run on 8 xdist workers: alone they took ~310 s on an
# H100, nearly all of it Triton compiling each GEMM parametrization's kernels on one CPU core):
#   run(command="bash tools/gpu_all.sh", carry=["build/gpu"], timeout_s=600)
# Each stage has its own time cap (seconds, overridable: TESTS_S, GEMM_S, ATTN_S, E2E_S) so that
# the call ends inside the tool's 600 s and a slow stage still leaves the others' results.
# Files in $OUT: summary.txt (stage, exit code, seconds), env.txt, pytest.log, gemm.json,
# attention.json, bench.log (the benchmarks' stderr), e2e.json, e2e.log (the e2e table).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STAGES=${*:-tests e2e gemm attn}
export PYTHONPATH="$PWD:$PWD/build/gpu/site${PYTHONPATH:+:$PYTHONPATH}"
export EDGEINFER_SLICE=${EDGEINFER_SLICE:-$PWD/build/gpu/slice}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], "torch", torch.__version__,
              "triton", triton.__version__, "transformers", transformers.__version__)' 2>&1
    git log --oneline -1 2>&1
    ls -la build/gpu build/gpu/slice 2>&1
} >"$OUT/env.txt"

if compgen -G "build/gpu/wheels/*.whl" >/dev/null; then
    "$PY" -m pip install --quiet --no-index --find-links build/gpu/wheels build/gpu/wheels/*.whl \
        >>"$OUT/env.txt" 2>&1 || echo "wheel install failed (see above)" >>"$OUT/env.txt"
fi

stage() {  # stage NAME CAP_SECONDS COMMAND...: run under a time cap, record rc and seconds
    local name=$1 cap=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$cap" "$@"
    local rc=$? note=""
    [ "$rc" = 124 ] && note=" (hit its ${cap}s cap)"
    echo "$name rc=$rc $((SECONDS - start))s$note" >>"$OUT/summary.txt"
}

for s in $STAGES; do
    case $s in
    tests)
        # Only the modules that hold GPU tests: the others need packages the image lacks
        # (jsonschema, openai, ...) and would end the stage with collection errors.
        workers=()
        "$PY" -c "import xdist" 2>/dev/null && workers=(-n "${TESTS_WORKERS:-8}")
        stage tests "${TESTS_S:-240}" "$PY" -m pytest -o addopts="" -p no:cacheprovider -m gpu -v -rs --durations=25 \
            "${workers[@]}" $(grep -rl "mark.gpu" tests) >"$OUT/pytest.log" 2>&1 ;;
    gemm)
        stage gemm "${GEMM_S:-120}" "$PY" tools/bench_gemm.py --json --cudagraph \
            >"$OUT/gemm.json" 2>>"$OUT/bench.log" ;;
    attn)
        stage attn "${ATTN_S:-60}" "$PY" tools/bench_attention.py --json \
            >"$OUT/attention.json" 2>>"$OUT/bench.log" ;;
    e2e)
        stage e2e "${E2E_S:-190}" "$PY" tools/bench_e2e_gpu.py --json-out "$OUT/e2e.json" \
            >"$OUT/e2e.log" 2>>"$OUT/bench.log" ;;
    *)
        echo "unknown stage $s (stages: tests gemm attn e2e)" >>"$OUT/summary.txt" ;;
    esac
done
cat "$OUT/summary.txt"
tail -n 25 "$OUT/pytest.log" 2>/dev/null
cat "$OUT/e2e.log" 2>/dev/null
exit 0
