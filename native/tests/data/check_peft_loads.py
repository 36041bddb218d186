"""Loads an adapter folder written by harness-s with peft over its base and compares peft's
logits of a row with the ones harness-s computed: the check of native/tests/lora.rs that
runs where torch, transformers and peft are installed (HARNESS_S_PEFT_PYTHON).

    python check_peft_loads.py ADAPTER_DIR BASE_DIR REFERENCE.safetensors

Prints the largest absolute difference of the adapted logits and of the merged logits.
"""
import sys

import peft
import torch
import transformers
from safetensors.torch import load_file

adapter, base, reference = sys.argv[1:4]
ref = load_file(reference)
model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
model = peft.PeftModel.from_pretrained(model, adapter).eval()
row = ref["row_ids"].to(torch.int64).view(1, -1)
with torch.no_grad():
    adapted = model(row).logits[0].float()
    merged = model.merge_and_unload()(row).logits[0].float()
print(f"adapted {float((adapted - ref['logits']).abs().max()):.3e} merged {float((merged - ref['logits']).abs().max()):.3e}")
