#!/usr/bin/env bash
# The GPU evaluation in one command, from the repository root of a checkout on a bare GPU machine:
#
#   bash benchmarks/gpu_run.sh [--budget-s 480]   on an H100/H200: preflight, LoRA tile sweep beside the
#                                                  peers (tuned table written), then benchmarks/gpu.py
#   bash benchmarks/gpu_run.sh --tiny              the same steps at tiny sizes on a CPU, the Triton kernels
#                                                  under the interpreter (tests/benchmarks/test_gpu_run.py)
#
# A machine without network needs, beside the tracked files (the device tool's `carry` for ignored paths):
#   build/gpu-wheels     python benchmarks/gpu_wheels.py --carry protobuf, run where PyPI is reachable
#   protos/lorafleet/v1  make proto (the generated gRPC stubs)
#   .peers               a copy of ../shared/peers (vLLM's and SGLang's kernels, never committed; optional)
# Steps run in order of value, each stopped at its share of the budget; every step writes its figures to
# $OUT as it goes (default benchmarks/results/run-DATE), so a run cut short keeps what it measured.
# $PYTHON names the interpreter (default python3). Exit status: 3 when the wheels do not install, 4 when
# the preflight fails, else that of the last step that did not pass (gpu.py: 1 a check failed, 3 parts
# left out for want of budget), 0 when every step passed whole.
set -uo pipefail
cd "$(dirname "$0")/.."

tiny=0
budget=480
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) tiny=1 ;;
    --budget-s) budget="$2"; shift ;;
    *) echo "usage: bash benchmarks/gpu_run.sh [--tiny] [--budget-s SECONDS]" >&2; exit 2 ;;
  esac
  shift
done
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results/run-$(date -u +%Y-%m-%d-%H%M)}
mkdir -p "$out" kernels/tuned

if [ $tiny = 0 ] && compgen -G "build/gpu-wheels/*.whl" > /dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/lorafleet-site build/gpu-wheels/*.whl || exit 3
  export PYTHONPATH=/tmp/lorafleet-site${PYTHONPATH:+:$PYTHONPATH}
fi
# The generated stubs import as lorafleet.v1 from protos/, where no editable install put them on the path.
export PYTHONPATH=$PWD/protos:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
peers=()
for p in .peers ../shared/peers; do
  if [ -d "$p/vllm_lora" ] && [ -d "$p/sglang_lora" ]; then peers=(--peers "$p"); break; fi
done
if [ $tiny = 1 ]; then
  # gpu.py in the GPU's dtype (bfloat16): its parity stages run as on the GPU, float32 one among them
  device=(--device cpu); sweep=(--tiny); gpu=(--model tiny --dtype bfloat16)
  budget=3600  # the interpreter on a loaded CPU: the steps are checked, not timed
else
  device=(--device cuda); sweep=(); gpu=()
fi
started=$SECONDS
left() { local s=$(( budget - (SECONDS - started) )); echo $(( s > 0 ? s : 0 )); }
status=0

timeout 300 "$python" benchmarks/gpu_preflight.py "${device[@]}" 2>&1 | tee "$out/preflight.log" || exit 4

# The sweep first: its table makes every later LoRA figure the tuned one. A third of the budget.
sweep_s=$(( budget / 3 ))
timeout $(( sweep_s + 30 )) "$python" benchmarks/lora_sweep.py "${sweep[@]}" "${device[@]}" "${peers[@]}" \
  --budget-s "$sweep_s" --out "$out/lora-sweep.json" 2>&1 | tee "$out/lora-sweep.log" || status=$?

# gpu.py: no part starts after the budget's end; the timeout leaves a part that started a minute.
# The sweep wrote its tuned table (a GPU run) beside its report.
timeout $(( $(left) + 60 )) "$python" benchmarks/gpu.py "${gpu[@]}" "${device[@]}" --budget-s "$(left)" \
  --out "$out/gpu.json" 2>&1 | tee "$out/gpu.log" || status=$?
echo "gpu_run: $(( SECONDS - started )) s; figures in $out; status $status"
exit $status
