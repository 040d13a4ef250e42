"""Write a GGUF checkpoint out as a float32 Hugging Face folder, for peers that serve
folders in float32 (vLLM's CPU build, `transformers serve`) beside us on the same weights.

    .venv/bin/python tools/gguf_to_hf.py --out /tmp/smollm2-f32 [--gguf PATH]

Default GGUF: the shipped SmolLM2-135M-Instruct Q4_1 file. transformers dequantizes it
(the same values our `--quantization none` path serves: tests/test_default_model.py
compares the two), then saves config, safetensors, tokenizer and chat template.
"""
from __future__ import annotations

import argparse
import json
import os

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gguf", default=None, help="a GGUF file (default: the shipped model)")
    a = p.parse_args()
    if a.gguf is None:
        from ferroxmp.checkpoint.default_model import default_model_path
        a.gguf = default_model_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.dirname(os.path.abspath(a.gguf)), os.path.basename(a.gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses to save a model it loaded from GGUF: save its float32 state and
    # its config without the GGUF marker instead (a tied head is stored once).
    from safetensors.torch import save_file
    os.makedirs(a.out, exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config
    for attr in ("quantization_config", "gguf_file"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg.save_pretrained(a.out)
    # Older readers (a peer's own transformers) want these at the top level.
    path = os.path.join(a.out, "config.json")
    with open(path) as f:
        d = json.load(f)
    d.setdefault("architectures", [type(model).__name__])
    if "rope_theta" not in d and "theta" not in d and d.get("rope_parameters", {}).get("rope_theta"):
        d["rope_theta"] = d["rope_parameters"]["rope_theta"]
    with open(path, "w") as f:
        json.dump(d, f, indent=2)
    model.generation_config.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    print(f"wrote {a.out} from {a.gguf}")


if __name__ == "__main__":
    main()
