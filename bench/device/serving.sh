#!/usr/bin/env bash
# On the device after env.sh: the random 8B-shape 4-bit checkpoint (once per machine, ~30 s),
# then `tandem serve` driven over HTTP (bench/gpu_serving.py). Override with TOPOS, CLIENTS,
# GS_S (seconds), EXTRA (more gpu_serving.py arguments). Output under $OUT.
set -uo pipefail
[ -f /tmp/m8b/config.json ] || python3 -c "
import sys; sys.path[:0] = ['bench', '.']
from pathlib import Path; import gpu_serving
gpu_serving.make_model(Path('/tmp/m8b'), '8b', gpu_serving.default_tokenizer_dir())" > "$OUT/make_model.log" 2>&1 \
  || { tail -5 "$OUT/make_model.log"; exit 3; }
# shellcheck disable=SC2086
KEEP_LOGS=1 timeout -k 5 "${GS_S:-560}" python3 bench/gpu_serving.py --model /tmp/m8b \
    --topologies "${TOPOS:-hybrid,disaggregated}" --clients "${CLIENTS:-1,16,64,128}" --engine-bench "${ENGINE:-same}" \
    --ready-timeout 360 --timeout 240 ${EXTRA:-} --out "$OUT/gs" > "$OUT/gs.log" 2>&1
echo "gpu_serving rc=$?"; grep -E "^(hybrid|disaggregated)" "$OUT/gs.log" | cut -c1-400; tail -5 "$OUT/gs.log"
for f in "$OUT"/gs-*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$f.t" && mv "$f.t" "$f"; done
grep -hE "GPU memory|KV store:|out of memory|graph step off|compiled in|warm" "$OUT"/gs-*.log 2>/dev/null | head -20
# The workers' stacks (--py-spy), summarized here: the raw files are large.
ls "$OUT"/gs-*-c*-*.txt >/dev/null 2>&1 && python3 bench/stacks.py "$OUT"/gs-*-c*-*.txt --top 8 > "$OUT/stacks.txt" \
    && head -c 6000 "$OUT/stacks.txt"
# Only so many files come back from $OUT: the raw stacks go, so gs.json and the logs return.
rm -f "$OUT"/gs-*-c*-*.txt
