# The peer of `harness-s bench learner --peer torch`: a plain PyTorch training step of the
# same llama (or qwen3: per-head q/k norms, an explicit head width) model shape, or for
# Qwen3.5 transformers' own `Qwen3_5ForCausalLM` of the same config (its PyTorch Gated
# DeltaNet, as on a machine without the fla kernels), and the same batch (rows, lengths, micro-batches under the same
# token budget, LM head on the completion positions only, a policy-gradient loss on the
# completion tokens, global-norm clipping, AdamW). Random weights: speed does not depend on
# their values. Prints one JSON object per (sequence length, group) row.
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

spec = json.loads(sys.argv[1])
c = spec.get("config")
device = torch.device(spec["device"])
torch.manual_seed(0)
if device.type == "cpu":
    torch.set_num_threads(spec["threads"])


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        h, hd = c["hidden"], c["head_dim"]
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)
        self.q, self.k, self.v = lin(h, c["heads"] * hd), lin(h, c["kv_heads"] * hd), lin(h, c["kv_heads"] * hd)
        self.o = lin(c["heads"] * hd, h)
        self.gate, self.up, self.down = lin(h, c["inter"]), lin(h, c["inter"]), lin(c["inter"], h)
        self.n1, self.n2 = torch.nn.Parameter(torch.ones(h)), torch.nn.Parameter(torch.ones(h))
        # qwen3: an RMSNorm of each head's queries and keys before RoPE
        self.qn = torch.nn.Parameter(torch.ones(hd)) if c["qk_norm"] else None
        self.kn = torch.nn.Parameter(torch.ones(hd)) if c["qk_norm"] else None


def rms(x, w):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + c["eps"]).to(x.dtype) * w


class Llama(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(c["vocab"], c["hidden"])
        self.layers = torch.nn.ModuleList([Layer() for _ in range(c["layers"])])
        self.norm = torch.nn.Parameter(torch.ones(c["hidden"]))
        self.head = None if c["tie"] else torch.nn.Linear(c["hidden"], c["vocab"], bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, ids, flat):
        b, t = ids.shape
        nh, nkv = c["heads"], c["kv_heads"]
        hd = c["head_dim"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, device=ids.device).float() / hd))
        ang = torch.outer(torch.arange(t, device=ids.device).float(), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

        def rope(x):
            x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
            return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)

        x = self.embed(ids)
        for l in self.layers:
            h = rms(x, l.n1)
            q, k = l.q(h).view(b, t, nh, hd), l.k(h).view(b, t, nkv, hd)
            if l.qn is not None:
                q, k = rms(q, l.qn), rms(k, l.kn)
            q, k = rope(q.transpose(1, 2)), rope(k.transpose(1, 2))
            v = l.v(h).view(b, t, nkv, hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
            x = x + l.o(a.transpose(1, 2).reshape(b, t, nh * hd))
            h = rms(x, l.n2)
            x = x + l.down(F.silu(l.gate(h)) * l.up(h))
        h = rms(x, self.norm).reshape(b * t, -1).index_select(0, flat)
        w = self.embed.weight if self.head is None else self.head.weight
        return h @ w.t()


class Transformers(torch.nn.Module):
    """transformers' model of `spec["hf_config"]`, with the LM head on `flat` only."""

    def __init__(self, hf):
        super().__init__()
        import transformers

        config = transformers.AutoConfig.for_model(**hf)
        self.lm = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    def forward(self, ids, flat):
        h = self.lm.model(input_ids=ids).last_hidden_state
        h = h.reshape(-1, h.shape[-1]).index_select(0, flat)
        return self.lm.lm_head(h)


model = (Transformers(spec["hf_config"]) if spec.get("hf_config") else Llama()).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["precision"] == "bf16")


def step(length, group):
    ctx = length // 2
    vocab = c["vocab"] if c else spec["hf_config"]["vocab_size"]
    rows = [[(i * 31 + j) % vocab for i in range(ctx)] + [(i * 17 + j * 7) % vocab for i in range(length - ctx)] for j in range(group)]
    adv = torch.tensor([1.0 if j % 2 else -1.0 for j in range(group)], device=device)
    per = max(1, spec["micro_batch_tokens"] // (length - 1))
    tokens = group * (length - ctx)
    opt.zero_grad(set_to_none=True)
    for s in range(0, group, per):
        ids = torch.tensor(rows[s : s + per], device=device)
        n = ids.shape[0]
        inp, tgt = ids[:, :-1], ids[:, ctx:]
        cols = torch.arange(ctx - 1, length - 1, device=device)
        flat = (torch.arange(n, device=device)[:, None] * (length - 1) + cols[None, :]).reshape(-1)
        with autocast:
            logits = model(inp, flat)
        logp = torch.log_softmax(logits.float(), -1).gather(1, tgt.reshape(-1, 1)).squeeze(1)
        ratio = torch.exp(logp - logp.detach())
        a = adv[s : s + n].repeat_interleave(length - ctx)
        loss = -(ratio * a).sum() / tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return tokens, (group + per - 1) // per


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize(device)


for _ in range(spec["warmup"]):
    step(*spec["rows"][0])
sync()
for length, group in spec["rows"]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    tokens, micro = step(length, group)
    sync()
    secs = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    print(json.dumps({"len": length, "group": group, "micro": micro, "tokens": tokens, "seconds": secs, "peak_bytes": peak}), flush=True)
