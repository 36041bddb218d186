"""Tiny random models of the families harness-s ports, made by transformers with a fixed
seed, and transformers' own outputs on them: the references of native/tests/families.rs.

    python native/tests/data/make_fixtures.py      # needs torch and transformers

Writes native/tests/data/<family>-tiny/{config.json, model.safetensors, reference.safetensors}:
  - prompt_ids [P] and logits [P, vocab]: one pass over a prompt;
  - decoded_ids [16] and step_logits [16, vocab]: greedy decoding with transformers' cache,
    the logits of each step;
  - grad.<param> for every parameter: the gradient of the summed log-probabilities of the
    decoded tokens given everything before them (one row, teacher-forced).
Float32 throughout, eager attention. The versions used are written to versions.txt.
"""
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))


def qwen3():
    cfg = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,  # not hidden / heads
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=1, eos_token_id=2, attn_implementation="eager",
    )
    return transformers.Qwen3ForCausalLM(cfg)


def qwen3_5():
    # [GDN, GDN, GDN, full] like the released models, at toy widths; more value heads than
    # key heads (the released models' grouping) and a partial rotary width of 4.
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        bos_token_id=1, eos_token_id=2, attn_implementation="eager",
    )
    return transformers.Qwen3_5ForCausalLM(cfg)


FAMILIES = {"qwen3": qwen3, "qwen3_5": qwen3_5}


def make(name, build):
    torch.manual_seed(1234)
    model = build().float().eval()
    # Norm weights start at 1 (or 0 for zero-centred norms): perturb every parameter so a
    # port that drops a norm or a bias cannot agree by accident.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = os.path.join(HERE, f"{name.replace('_', '.')}-tiny")
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, model.config.vocab_size, (1, 12), generator=g)
    with torch.no_grad():
        logits = model(prompt).logits[0]
        # greedy decoding, one token per step on the cache
        step_logits, ids = [], []
        out_ = model(prompt, use_cache=True)
        cache, nxt = out_.past_key_values, out_.logits[0, -1].argmax()
        for _ in range(16):
            ids.append(int(nxt))
            o = model(nxt.view(1, 1), past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            step_logits.append(o.logits[0, -1])
            nxt = o.logits[0, -1].argmax()
    decoded = torch.tensor(ids)
    row = torch.cat([prompt[0], decoded])
    model.zero_grad()
    lp = torch.log_softmax(model(row.view(1, -1)).logits[0].float(), -1)
    p = prompt.shape[1]
    loss = lp[p - 1:-1].gather(1, row[p:].view(-1, 1)).sum()
    loss.backward()
    ref = {
        "prompt_ids": prompt[0].to(torch.int64),
        "logits": logits.contiguous(),
        "decoded_ids": decoded.to(torch.int64),
        "step_logits": torch.stack(step_logits).contiguous(),
        "logprob_sum": loss.detach().view(1),
    }
    for n, prm in model.named_parameters():
        ref[f"grad.{n}"] = prm.grad.contiguous()
    save_file(ref, os.path.join(out, "reference.safetensors"))
    print(f"{out}: {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    for name in sys.argv[1:] or FAMILIES:
        make(name, FAMILIES[name])
    with open(os.path.join(HERE, "versions.txt"), "w") as f:
        f.write(f"torch {torch.__version__}\ntransformers {transformers.__version__}\n")
