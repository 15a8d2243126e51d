#!/usr/bin/env bash
# The measurements the README and the performance chapters quote, taken with one commit in consecutive calls
# on one GPU. Each stage fits one 10-minute device call; run them in order, with no code change between them:
#
#   FA_LIB_COMMIT=<commit> OUT=<dir> bash benchmarks/one_sweep.sh bf16   # extended sweep, bf16 (112 points)
#   FA_LIB_COMMIT=<commit> OUT=<dir> bash benchmarks/one_sweep.sh fp16   # extended sweep, fp16 (112 points)
#   FA_LIB_COMMIT=<commit> OUT=<dir> bash benchmarks/one_sweep.sh rest   # decoding, masks and memory
#
# FA_LIB_COMMIT names the commit measured (the copy of the tree on a lent GPU has no .git); every file records
# it. Each stage writes its JSON under $OUT/<stage>/. Then, on any machine, join the two halves of the extended
# sweep (python -m benchmarks.bench refuses halves of different commits or cards) and replace the data whole:
#
#   python -m benchmarks.bench --extended --ext-join bf16/extended-<card>.json fp16/extended-<card>.json \
#       --out-dir benchmarks/data
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:?usage: one_sweep.sh bf16|fp16|rest}"
: "${FA_LIB_COMMIT:?set FA_LIB_COMMIT to the commit being measured}"
: "${OUT:?set OUT to the directory that receives the JSON files}"
export FA_LIB_COMMIT
dir="$OUT/$stage"
mkdir -p "$dir"
case "$stage" in
    bf16 | fp16)
        # Shorter timings than the defaults (10 ms warm-up, 50 ms of repetitions per timing) and 8 compile
        # workers keep a dtype's 112 points, five providers each, forward and backward, inside one call.
        python -m benchmarks.bench --extended --ext-dtypes "$stage" --ext-precompile 8 \
            --ext-warmup-ms 10 --ext-rep-ms 50 --out-dir "$dir" ;;
    rest)
        python -m benchmarks.bench --decode --out-dir "$dir"
        python -m benchmarks.bench --masks --out-dir "$dir"
        python -m benchmarks.bench --memory --out-dir "$dir" ;;
    *)
        echo "unknown stage '$stage': expected bf16, fp16 or rest" >&2
        exit 2 ;;
esac
ls -l "$dir"
