"""A real checkpoint that answers every chat with SCRIPT, for the browser tests.

A tiny Llama (ferroxmp.tiny_model) whose weights are set so that greedy decoding writes
SCRIPT, whatever the conversation: its attention and MLP outputs are zeroed, so the
hidden state at each position is the embedding of that position's token, and `lm_head`
maps the (normed) embedding of each token of the script to the next one, the last to
<|im_end|>: a bigram table in weights. Two added tokens (real tokenizer `added_tokens`,
as "<think>" is for Qwen3) carry the markup, and the script is spelled with tokens that
are all distinct, so that the table is a function. The server runs it like any model:
tokenizer, scheduler, worker forward, sampling, detokenizer and SSE are all real.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from ferroxmp.tiny_model import EOS_TOKEN_IDS, IM_END, IM_START, build_model

MARKUP = ["<script>alert(1)</script>", "<img src=x onerror=alert(document.domain)>"]
SCRIPT = ("Hi! This reply comes from scripted weights. Markup stays text: "
          "<script>alert(1)</script><img src=x onerror=alert(document.domain)>")


def _distinct_segmentation(tok: Tokenizer, text: str, banned: set[int]) -> list[int]:
    """Token ids that decode to `text`, no id twice (so a bigram table can spell it).

    A seeded random walk (longer pieces likelier), restarted until one gets through: a
    depth-first search drowns in the many ways to spell the common letters."""
    pieces = {i: tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())}
    at = [[i for i, s in pieces.items() if s and "\ufffd" not in s and i not in banned and text.startswith(s, p)]
          for p in range(len(text))]
    for ids in at:
        ids.sort(key=lambda i: -len(pieces[i]))
    rng = random.Random(0)
    for _ in range(50_000):
        pos, used = 0, []
        while pos < len(text):
            options = [i for i in at[pos] if i not in used]
            if not options:
                break
            used.append(options[min(int(rng.expovariate(1.0)), len(options) - 1)])
            pos += len(pieces[used[-1]])
        else:
            assert tok.decode(used) == text
            return used
    raise AssertionError("no segmentation of SCRIPT into distinct tokens; reword it")


def build_scripted_model(out_dir: str, script: str = SCRIPT, markup: list[str] = MARKUP,
                         chat_template: str | None = None,
                         prompt_tail: str = "<|im_start|>assistant\n") -> tuple[str, list[int]]:
    """A Llama checkpoint that answers every chat with `script` (greedy), spelled with
    `markup` as added tokens. `chat_template` replaces the chat template (its generation
    prompt must end with `prompt_tail`, whose last token triggers the script). Returns
    (path, script ids)."""
    base = build_model("llama", out_dir + "-base")
    shutil.copytree(base, out_dir)
    if chat_template is not None:
        with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(chat_template)
    with open(os.path.join(out_dir, "tokenizer.json")) as f:
        tj = json.load(f)
    vocab = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json")).get_vocab_size()
    for k, content in enumerate(markup):
        tj["added_tokens"].append({"id": vocab + k, "content": content, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": False})
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tj, f)
    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    # The chat template ends every prompt with this token: the script starts after it.
    trigger = tok.encode(prompt_tail).ids[-1]
    ids = _distinct_segmentation(tok, script, banned={trigger, *EOS_TOKEN_IDS, IM_START})

    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = vocab + len(markup)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    w = load_file(os.path.join(out_dir, "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(1)
    w["model.embed_tokens.weight"] = torch.cat([emb, torch.randn(len(markup), emb.shape[1], generator=gen)])
    for name in w:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            w[name] = torch.zeros_like(w[name])  # the residual stream stays the token's embedding
    emb, eps = w["model.embed_tokens.weight"], float(cfg.get("rms_norm_eps", 1e-6))
    normed = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + eps) * w["model.norm.weight"]
    head = torch.zeros(cfg["vocab_size"], emb.shape[1])
    # logit(t | cur) = 8 * |normed[cur]| * cos(normed[cur], normed[the token before t]):
    # by Cauchy-Schwarz the largest is the row built from cur itself; other rows are 0.
    for cur, nxt in zip([trigger] + ids, ids + [IM_END]):
        head[nxt] = 8.0 * normed[cur] / normed[cur].norm()
    w["lm_head.weight"] = head
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(out_dir, "model.safetensors"))
    return out_dir, ids
