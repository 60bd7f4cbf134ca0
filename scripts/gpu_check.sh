#!/usr/bin/env bash
# GPU check of kernels_cupy: kernels vs reference, decode bandwidth vs copy, end-to-end tokens,
# engine decode tokens/s. Prints a table last; writes $OUT/gpu_check.json and $OUT/gpu_check.log when
# $OUT is set. Exit 0: all pass; 1: a check failed; 2: no CUDA GPU (one line, no traceback).
#   usage: scripts/gpu_check.sh [--parts kernels,bandwidth,e2e,engine] [--quick]
#   env:   PYTHON (default: /opt/torch/.venv/bin/python3, then .venv/bin/python, then python3)
#          GATEWAY_MODEL (model file; default backend.model_path.default_model_path())
#          GPU_CHECK_FIXTURES (folder holding smollm2_chats.json; default tests/fixtures)
# Wheels carried in .whl/ (msgspec, gguf, ... for a GPU machine without them) are installed into /tmp/site
# when the python lacks them.
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in /opt/torch/.venv/bin/python3 .venv/bin/python python3; do
    if [ -x "$c" ] || command -v "$c" >/dev/null 2>&1; then PY=$c; break; fi
  done
fi
if ! "$PY" -c 'import msgspec, gguf' >/dev/null 2>&1; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
export PYTHONUNBUFFERED=1
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  set -o pipefail
  "$PY" scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
exec "$PY" scripts/gpu_check.py "$@"
