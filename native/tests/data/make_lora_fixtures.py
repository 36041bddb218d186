"""LoRA adapters made by peft on the tiny fixtures of make_fixtures.py, and peft's own
outputs with them: the references of native/tests/lora.rs.

    python native/tests/data/make_lora_fixtures.py      # needs torch, transformers and peft

For each of qwen3-tiny and qwen3.5-tiny, writes native/tests/data/<family>-tiny/lora/:
  - adapter_model.safetensors and adapter_config.json: peft's `save_pretrained` of a rank-4
    adapter (alpha 8) on every linear layer of the decoder (`all-linear`), both factors
    random (`init_lora_weights=False`, then B perturbed so no factor is zero);
    `base_model_name_or_path` is the base fixture's folder name;
  - reference.safetensors: `row_ids` [T], the adapted model's `logits` [T, vocab] of the
    row, `merged_logits` after peft's `merge_and_unload`, `logprob_sum` (the summed
    log-probabilities of the row's last 8 tokens given what precedes them) and
    `grad.<peft key>`: its gradient with respect to every adapter factor.
Float32 throughout, eager attention. The versions used are appended to versions.txt.
"""
import json
import os
import sys

import peft
import torch
import transformers
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ["qwen3-tiny", "qwen3.5-tiny"]


def make(name):
    base_dir = os.path.join(HERE, name)
    torch.manual_seed(4321)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p) * 0.05)
    out = os.path.join(base_dir, "lora")
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    os.remove(os.path.join(out, "README.md"))  # peft's model card: not a reference
    # name the base by its folder beside this one, as the Rust test finds it
    path = os.path.join(out, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = name
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    g = torch.Generator().manual_seed(11)
    row = torch.randint(3, model.config.vocab_size, (20,), generator=g)
    model.zero_grad()
    logits = model(row.view(1, -1)).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    loss = lp[11:-1].gather(1, row[12:].view(-1, 1)).sum()
    loss.backward()
    ref = {"row_ids": row.to(torch.int64), "logits": logits.detach().contiguous(), "logprob_sum": loss.detach().view(1)}
    for n, p in model.named_parameters():
        if p.grad is not None and "lora_" in n:
            # peft's saved names: without the adapter's name `default`
            ref["grad." + n.replace(".default", "")] = p.grad.contiguous()
    with torch.no_grad():
        merged = model.merge_and_unload()
        ref["merged_logits"] = merged(row.view(1, -1)).logits[0].float().contiguous()
    save_file(ref, os.path.join(out, "reference.safetensors"))
    print(f"{out}: {sum(1 for k in ref if k.startswith('grad.'))} adapter factors")


if __name__ == "__main__":
    for name in sys.argv[1:] or FAMILIES:
        make(name)
    with open(os.path.join(HERE, "versions.txt"), "a") as f:
        f.write(f"peft {peft.__version__}\n")
