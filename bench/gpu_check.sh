#!/usr/bin/env bash
# GPU check: build llama-cpp-python with CUDA, run a 2-node ring on this machine with every
# layer of both windows on the GPU (--n-gpu-layers 99), and check the ring's greedy answer
# against the unsplit model (on the CPU build's reference path: tests/ring_fixtures'
# assert_same_greedy, which accepts a difference only at a near-tie of the unsplit logits).
#
#   bash bench/gpu_check.sh                # from the repository root, on a machine with CUDA
#   CUDA_ARCH=87 bash bench/gpu_check.sh   # Jetson Orin (sets CMAKE_CUDA_ARCHITECTURES)
#
# Prints one JSON line (the GPU, the tokens compared, the verdict) and exits non-zero on a
# real difference. Nothing here runs in the default test suite: the project's machines have no
# GPU. It needs the CUDA toolkit (nvcc) and about 10 minutes for the build.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: no NVIDIA GPU here" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "gpu_check: no nvcc: install the CUDA toolkit" >&2; exit 2; }

VENV=${VENV:-.venv-gpu}
ARGS="-DGGML_CUDA=on"
[ -n "${CUDA_ARCH:-}" ] && ARGS="$ARGS -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
python3 -m venv "$VENV"
CMAKE_ARGS="$ARGS" "$VENV/bin/pip" install -q --no-binary llama-cpp-python -e ".[test]"
"$VENV/bin/python" -c "import llama_cpp; assert llama_cpp.llama_supports_gpu_offload(), 'llama.cpp built without GPU offload'"

WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
export EDGESPEC_HOME="$WORK/home" OMP_WAIT_POLICY=passive
KEY="$WORK/ring.key"
"$VENV/bin/edgespec" keygen --key-file "$KEY" >/dev/null
MODEL=$("$VENV/bin/python" -c "from edgespec.llm import models; print(models.ensure('qwen2.5-coder-0.5b'))")
for port in 7711 7712; do
  "$VENV/bin/edgespec" node --port $port --bind 127.0.0.1 --no-mdns --name "gpu$port" \
    --key-file "$KEY" --n-gpu-layers 99 > "$WORK/node$port.log" 2>&1 &
done
sleep 5
"$VENV/bin/edgespec" ring up --model "$MODEL" --nodes 127.0.0.1:7711,127.0.0.1:7712 \
  --key-file "$KEY" --no-profile > "$WORK/up.log"

PYTHONPATH=tests "$VENV/bin/python" - "$MODEL" "$KEY" <<'EOF'
import json, subprocess, sys
from pathlib import Path

from ring_fixtures import assert_same_greedy, unsplit_greedy

from edgespec.api import Ring

model, key = Path(sys.argv[1]), sys.argv[2]
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
with Ring.attach(key=key, spec="none") as ring:
    prompt = ring.tokenizer.encode("def fibonacci(n):", add_special=True, parse_special=False)
    got = ring.generate(prompt, max_tokens=32).tokens
    backends = sorted({s.get("backend") for s in ring.describe()["stages"]})
ref = unsplit_greedy(model, prompt, 32)
verdict = "identical" if got == ref else "near-tie"
try:
    assert_same_greedy(got, ref, model, prompt, "GPU ring vs unsplit")
except AssertionError as e:
    verdict = f"DIFFERENT: {e}"
print(json.dumps({"gpu": gpu, "backends": backends, "tokens": len(got), "verdict": verdict}))
sys.exit(0 if not verdict.startswith("DIFFERENT") else 1)
EOF
