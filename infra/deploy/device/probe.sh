#!/usr/bin/env bash
# The GPU probe: runs on a CUDA machine from the repository root with .device/ (made by
# infra/deploy/device/build.sh) beside it; writes its log and summary to $OUT (or ./probe-out).
#
#   bash infra/deploy/device/probe.sh
#
# Each step has its own timeout; their sum is under the 10 minutes of one device call (the steps
# themselves take far less on an H100/H200):
#   1. learner bench, bf16 mixed precision, SmolLM2-135M's shape, beside a plain PyTorch
#      bf16 step (autocast, float32 master weights) of the same model and batch: policy
#      tokens/s, GPU memory and the ratio, at a few sequence lengths and group sizes;
#   2. the same in float32;
#   3. a real GRPO step replayed from stored trajectories (.device/replay) on the CPU and
#      on the GPU: the losses must agree within 1e-3;
#   4. a resume on the GPU: update, checkpoint, update; reload and repeat the update;
#   5. `harness-s serve --device cuda` (bf16 weights) under 1 and 8 clients, on a model of
#      SmolLM2-135M's shape made here (seeded random weights, the real tokenizer files).
#
#   bash infra/deploy/device/probe.sh qwen3.5
#
# runs instead the learner bench at Qwen3.5-0.8B's and Qwen3.5-4B's shapes (random weights,
# bf16 mixed precision) beside transformers' own Qwen3_5ForCausalLM step of the same config
# and batch (the peer needs `transformers` in the device's Python; without the fla kernels it
# runs transformers' PyTorch Gated DeltaNet).
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-$PWD/probe-out}
mkdir -p "$OUT"
LOG=$OUT/probe.log
SUMMARY=$OUT/summary.txt
: > "$LOG"; : > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
PY=${PYTHON:-python3}

[ -f .device/harness-s.xz ] || { echo "probe.sh: .device/harness-s.xz is missing; run infra/deploy/device/build.sh here first" >&2; exit 2; }
BIN=/tmp/harness-s-cuda
xz -dc .device/harness-s.xz > "$BIN" && chmod +x "$BIN"
TORCH_LIB=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
NV_LIBS=$("$PY" - <<'EOF'
import glob, os, site
dirs = []
for base in site.getsitepackages():
    dirs += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib")))
    dirs += sorted(glob.glob(os.path.join(base, "nvidia", "cu*", "lib")))
print(":".join(dict.fromkeys(dirs)))
EOF
)
export LD_LIBRARY_PATH=$TORCH_LIB${NV_LIBS:+:$NV_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The font libraries of the plots come from .device/lib only where the image lacks them.
if ! ldconfig -p 2>/dev/null | grep -q 'libfontconfig.so.1 '; then export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$PWD/.device/lib; fi

note "# harness-s GPU probe, $(date -u +%FT%TZ)"
note "$(cat .device/VERSIONS)"
note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
note "python torch: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"

run_step() { # name timeout command...
  local name=$1 limit=$2; shift 2
  echo "== $name (timeout ${limit}s): $*" >> "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.out" 2>> "$LOG"
  local rc=$?
  cat "$OUT/$name.out" >> "$LOG"
  note ""
  note "## $name: exit $rc in $((SECONDS - t0)) s"
  cat "$OUT/$name.out" >> "$SUMMARY"
  return $rc
}

if ! "$BIN" generate --help > /dev/null 2>> "$LOG"; then
  note "the binary does not start (see probe.log: a missing library?)"; exit 1
fi

if [ "${1:-}" = qwen3.5 ]; then
  note "python transformers: $("$PY" -c 'import transformers; print(transformers.__version__)' 2>&1 | tail -1)"
  QWEN=(bench learner --device cuda --precision bf16 --warmup 1 --peer torch --python "$PY")
  run_step learner-qwen3.5-0.8b 240 "$BIN" "${QWEN[@]}" --shape qwen3.5-0.8b --seq-lens 512,1024 --groups 8 --micro-batch-tokens 8192
  run_step learner-qwen3.5-4b 300 "$BIN" "${QWEN[@]}" --shape qwen3.5-4b --seq-lens 512 --groups 8 --micro-batch-tokens 4096
  note ""
  note "probe finished in $SECONDS s"
  exit 0
fi

COMMON=(bench learner --device cuda --shape smollm2-135m --seq-lens 256,512,1024 --groups 8,16 --micro-batch-tokens 16384 --warmup 2 --peer torch --python "$PY")
run_step learner-bf16 120 "$BIN" "${COMMON[@]}" --precision bf16
run_step learner-f32 120 "$BIN" "${COMMON[@]}" --precision f32

read -r RUN STEP < .device/replay/RUN
REPLAY=(bench learner --shape smollm2-135m --replay .device/replay/store --run "$RUN" --step "$STEP" --tokenizer .device/replay/tokenizer --micro-batch-tokens 4096)
run_step replay-cpu 90 "$BIN" "${REPLAY[@]}" --device cpu --threads 16
run_step replay-cuda 45 "$BIN" "${REPLAY[@]}" --device cuda
# The loss of a first GRPO pass is near 0 by construction (ratio 1, advantages centred per
# group), so the gradient norm is compared too, relatively.
"$PY" - "$OUT/replay-cpu.out" "$OUT/replay-cuda.out" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import re, sys
def read(path):
    text = open(path).read()
    return {k: float(v) for k, v in re.findall(r"(loss|grad_norm)=([-0-9.eE+]+)", text)}
cpu, gpu = read(sys.argv[1]), read(sys.argv[2])
if not cpu or not gpu:
    sys.exit("replayed GRPO step: a device printed no loss (see probe.log)")
dl = abs(cpu["loss"] - gpu["loss"])
dg = abs(cpu["grad_norm"] - gpu["grad_norm"]) / max(abs(cpu["grad_norm"]), 1e-12)
print(f"\n## replayed GRPO step: loss CPU {cpu['loss']:.9f} GPU {gpu['loss']:.9f} (|difference| {dl:.2e}, target 1e-3: {'met' if dl <= 1e-3 else 'MISSED'}); "
      f"gradient norm CPU {cpu['grad_norm']:.9f} GPU {gpu['grad_norm']:.9f} (relative difference {dg:.2e}, {'within' if dg <= 1e-3 else 'OVER'} 1e-3)")
EOF

run_step resume-cuda 45 "$BIN" bench learner --device cuda --shape smollm2-135m --seq-lens 512 --groups 8 --resume-check

# A model of SmolLM2-135M's shape with seeded random weights, in Hugging Face layout, and the
# real tokenizer files.
MODEL=/tmp/smollm2-shape
timeout 60 "$PY" - "$MODEL" <<'EOF' >> "$LOG" 2>&1
import json, os, sys, shutil
import torch
from safetensors.torch import save_file
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
       "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
       "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
       "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
g = torch.Generator().manual_seed(0)
r = lambda *s: (torch.randn(*s, generator=g) * 0.02)
t = {"model.embed_tokens.weight": r(49152, 576), "model.norm.weight": torch.ones(576)}
for i in range(30):
    p = f"model.layers.{i}."
    t.update({p + "self_attn.q_proj.weight": r(576, 576), p + "self_attn.k_proj.weight": r(192, 576),
              p + "self_attn.v_proj.weight": r(192, 576), p + "self_attn.o_proj.weight": r(576, 576),
              p + "mlp.gate_proj.weight": r(1536, 576), p + "mlp.up_proj.weight": r(1536, 576),
              p + "mlp.down_proj.weight": r(576, 1536), p + "input_layernorm.weight": torch.ones(576),
              p + "post_attention_layernorm.weight": torch.ones(576)})
save_file(t, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
for f in os.listdir(".device/replay/tokenizer"):
    shutil.copy(os.path.join(".device/replay/tokenizer", f), out)
print("model written to", out)
EOF
run_step serve-cuda 100 "$BIN" bench serve --model "$MODEL" --device cuda --weights bf16 --no-reference --clients 1,8 --requests 4 --max-tokens 64 --threads 8 --python "$PY"

note ""
note "probe finished in $SECONDS s"
