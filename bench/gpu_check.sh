#!/usr/bin/env bash
# GPU check: build llama-cpp-python with CUDA, run a 2-node ring on this machine with every
# layer of both windows on the GPU (--n-gpu-layers 99), and check the ring's greedy answer in
# modes none, sync and flow against the unsplit model on the CPU (tests/ring_fixtures'
# assert_same_greedy, which accepts a difference only at a near-tie of the unsplit logits).
#
#   bash bench/gpu_check.sh                # from the repository root, on a machine with CUDA
#   CUDA_ARCH=87 bash bench/gpu_check.sh   # Jetson Orin (sets CMAKE_CUDA_ARCHITECTURES)
#   PYTHON=python3 MODEL=m.gguf bash bench/gpu_check.sh
#       # an interpreter that already has edgespec and a GPU build of llama-cpp-python (no
#       # venv, no build), and another GGUF than the default model (no fetch: for a machine
#       # with no network)
#
# Prints one JSON line (the GPU, each node's device as `ring status` shows it, per mode the
# tokens compared, tokens/s and the verdict) and exits non-zero on a real difference. Nothing here runs in the default test suite: the project's machines have no
# GPU. It needs the CUDA toolkit (nvcc) and about 10 minutes for the build.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: no NVIDIA GPU here" >&2; exit 2; }
if [ -z "${PYTHON:-}" ]; then
  command -v nvcc >/dev/null || { echo "gpu_check: no nvcc: install the CUDA toolkit" >&2; exit 2; }
  VENV=${VENV:-.venv-gpu}
  ARGS="-DGGML_CUDA=on"
  [ -n "${CUDA_ARCH:-}" ] && ARGS="$ARGS -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
  python3 -m venv "$VENV"
  # pip's wheel cache is keyed by the sdist, not CMAKE_ARGS: bypass it, or a cached CPU wheel
  # comes back (and a CUDA one would poison the cache for CPU venvs).
  CMAKE_ARGS="$ARGS" "$VENV/bin/pip" install -q --no-cache-dir --no-binary llama-cpp-python \
    -e ".[test]"
  PYTHON="$VENV/bin/python"
fi
EDGESPEC=("$PYTHON" -m edgespec)
"$PYTHON" -c "import llama_cpp; assert llama_cpp.llama_supports_gpu_offload(), 'llama.cpp built without GPU offload'"

WORK=$(mktemp -d)
# On failure, the nodes' and the ring's own words say why: print them before they go.
trap 'rc=$?; [ $rc = 0 ] || tail -n 25 "$WORK"/*.log >&2; kill $(jobs -p) 2>/dev/null || true
      rm -rf "$WORK"' EXIT
export EDGESPEC_HOME="$WORK/home" OMP_WAIT_POLICY=passive
KEY="$WORK/ring.key"
"${EDGESPEC[@]}" keygen --key-file "$KEY" >/dev/null
MODEL=${MODEL:-$("$PYTHON" -c "from edgespec.llm import models; print(models.ensure('qwen2.5-coder-0.5b'))")}
for port in 7711 7712; do
  "${EDGESPEC[@]}" node --port $port --bind 127.0.0.1 --no-mdns --name "gpu$port" \
    --key-file "$KEY" --n-gpu-layers 99 > "$WORK/node$port.log" 2>&1 &
done
sleep 5
"${EDGESPEC[@]}" ring up --model "$MODEL" --nodes 127.0.0.1:7711,127.0.0.1:7712 \
  --key-file "$KEY" --no-profile > "$WORK/up.log" 2>&1

PYTHONPATH="tests${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - "$MODEL" "$KEY" <<'EOF'
import json, subprocess, sys, time
from pathlib import Path

from ring_fixtures import assert_same_greedy, unsplit_greedy

from edgespec.api import Ring

model, key = Path(sys.argv[1]), sys.argv[2]
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
results, bad = {}, False
with Ring.attach(key=key, spec="none") as ring:
    prompt = ring.tokenizer.encode("def fibonacci(n):", add_special=True, parse_special=False)
    view = ring.describe()
    devices = [f"{s.get('node')}: {s.get('device') or s.get('backend')}, "
               f"{s.get('gpu_layers')} layers on the GPU" for s in view["stages"]]
    ref = unsplit_greedy(model, prompt, 64)
    for mode in ("none", "sync", "flow"):
        ring.reset()
        t0 = time.perf_counter()
        got = ring.generate(prompt, max_tokens=64, spec=mode).tokens
        dt = time.perf_counter() - t0
        verdict = "identical" if got == ref else "near-tie"
        try:
            assert_same_greedy(got, ref, model, prompt, f"GPU ring ({mode}) vs unsplit")
        except AssertionError as e:
            verdict, bad = f"DIFFERENT: {e}", True
        results[mode] = {"tokens": len(got), "tok_s": round(len(got) / dt, 1),
                         "verdict": verdict}
print(json.dumps({"gpu": gpu, "stages": devices, "modes": results}))
sys.exit(1 if bad else 0)
EOF
