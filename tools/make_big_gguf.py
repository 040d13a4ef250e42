"""A random-weight GGUF of a bigger Llama shape, with another GGUF's tokenizer and types.

    tools/make_big_gguf.py --out /tmp/smollm2-1.7b-q41.gguf     # SmolLM2-1.7B's shape

For memory and speed at a size no shipped file has (no model hub here): every tensor
gets the storage type the `--like` file gives its kind (the shipped SmolLM2 Q4_1: Q8_0
embedding, Q4_1 projections, F32 norms), random blocks whose values spread like a
trained model's (~0.02), and every metadata field of `--like` (tokenizer, chat template)
except the shape. Its answers are noise; llama-server and ferroxmp both load and serve it.
"""
from __future__ import annotations

import argparse
import re

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

SHAPE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "rope.dimension_count")


def random_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] of `qtype` blocks with values of spread ~0.02."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    if qtype == Q.F32:
        return np.ones((rows, cols), np.float32) if rows == 1 else \
            rng.normal(0, 0.02, (rows, cols)).astype(np.float32)
    if qtype == Q.Q8_0:
        head = np.full((n, 1), 0.02 / 64, np.float16).view(np.uint8)
        body = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
    elif qtype == Q.Q4_1:
        d, m = 0.004, -0.032  # q * d + m over q in 0..15: -0.032..0.028
        head = np.tile(np.array([d, m], np.float16), (n, 1)).view(np.uint8)
        body = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    elif qtype == Q.Q4_0:
        head = np.full((n, 1), 0.004, np.float16).view(np.uint8)
        body = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    else:
        raise SystemExit(f"{qtype.name}: no random writer (Q8_0, Q4_1, Q4_0, F32)")
    return np.concatenate([head, body], axis=1).reshape(rows, cols // block * size)


def main() -> None:
    from ferroxmp.checkpoint.default_model import default_model_path
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--like", default=None, help="GGUF whose metadata and types to copy (default: the shipped SmolLM2)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    like = gguf.GGUFReader(a.like or default_model_path())
    arch = like.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(a.out, arch)
    shape = dict(zip(SHAPE_KEYS, (a.layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.hidden // a.heads)))
    for key, field in like.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        own = key.removeprefix(arch + ".")
        value = shape[own] if own in shape else field.contents()
        w.add_key_value(key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    types = {re.sub(r"^blk\.\d+\.", "", t.name): Q(t.tensor_type) for t in like.tensors}
    vocab = int(like.fields[f"{arch}.vocab_size"].contents())
    hd, kv = a.hidden // a.heads, a.hidden // a.heads * a.kv_heads
    dims = {"token_embd.weight": (vocab, a.hidden), "output_norm.weight": (1, a.hidden),
            "attn_norm.weight": (1, a.hidden), "ffn_norm.weight": (1, a.hidden),
            "attn_q.weight": (a.heads * hd, a.hidden), "attn_k.weight": (kv, a.hidden),
            "attn_v.weight": (kv, a.hidden), "attn_output.weight": (a.hidden, a.heads * hd),
            "ffn_gate.weight": (a.ffn, a.hidden), "ffn_up.weight": (a.ffn, a.hidden),
            "ffn_down.weight": (a.hidden, a.ffn)}
    rng = np.random.default_rng(a.seed)
    names = [n for n in types if not n.startswith(("attn", "ffn"))]
    names += [f"blk.{i}.{n}" for i in range(a.layers) for n in types if n.startswith(("attn", "ffn"))]
    for name in names:
        kind = re.sub(r"^blk\.\d+\.", "", name)
        rows, cols = dims[kind]
        data = random_blocks(rows, cols, types[kind], rng)
        if types[kind] == Q.F32:
            w.add_tensor(name, data.reshape(-1) if rows == 1 else data)
        else:
            w.add_tensor(name, data, raw_dtype=types[kind])  # shape: from the bytes per row
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(a.out)


if __name__ == "__main__":
    main()
