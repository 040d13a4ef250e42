"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3.

Job: embeddings -> N x (RMSNorm, attention with RoPE over the paged KV pool, RMSNorm,
SwiGLU MLP) -> final norm -> lm_head, on a flat batch of tokens; the attention backend
(planned once per step by the runner) does the paged part, layer by layer.
The four architectures differ only by flags read from ModelConfig and by which tensors
the checkpoint holds: q/k/v biases (Qwen2), q/k RMSNorm (Qwen3), tied embeddings,
llama3 RoPE scaling, a sliding window (Mistral; handled by the plan).

Invariants:
- Numerics follow transformers: RMSNorm in float32 then cast back before the weight,
  RoPE cos/sin computed in float32 from position * inv_freq then cast, softmax scale
  head_dim ** -0.5. q/k/v and gate/up are fused into one matmul each (row-wise the
  same dot products).
- RoPE uses each token's absolute position (a chunk or an adopted row starts at its
  own start, never 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ferroxmp.gpu_worker.attention import AttentionBackend
from ferroxmp.gpu_worker.loader import ModelConfig
from ferroxmp.gpu_worker.quant import PackedF32, cat_rows
from ferroxmp.gpu_worker.quant import linear as quant_linear
from ferroxmp.gpu_worker.quant import pack as quant_pack
from ferroxmp.heap import release_freed_memory


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling or {}
    if cfg.rope_type == "linear":
        return inv / float(sc["factor"])
    if cfg.rope_type == "llama3":
        factor, lo_f, hi_f = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / lo_f, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo_f) / (hi_f - lo_f)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi_f) * ~(wavelen > old_ctx / lo_f)
        return torch.where(medium, smoothed, scaled)
    return inv


def embedding(ids: torch.Tensor, table, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the embedding table in `dtype` (float, float16 kept by --quantization
    fp16, or Groups / Int4x16 dequantized row by row)."""
    return F.embedding(ids, table).to(dtype) if isinstance(table, torch.Tensor) else table.lookup(ids, dtype)


@dataclass
class Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: Optional[torch.Tensor]
    w_o: torch.Tensor
    b_o: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


class DecoderLM:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 f32_panels: bool = False):
        self.cfg = cfg
        self.device = device
        # Hooks the worker may replace (one place each, so modes never edit forward()):
        # `linear` - a batch-invariant matmul in deterministic mode; `reduce_sum` - the
        # all-reduce after row-parallel layers under tensor parallelism (identity at tp=1);
        # `gather_vocab` - joins vocab-parallel logits (identity at tp=1).
        self.linear = quant_linear  # F.linear for float weights; the weight's kernel for quant's forms
        self.reduce_sum = lambda x: x
        self.gather_vocab = lambda x: x
        # `embed_ids` - a vocab-parallel lookup under tensor parallelism.
        self.embed_ids = lambda ids: embedding(ids, self.embed, cfg.dtype)
        # `fused_decode` - quant/fused_decode.py's one-call step for up to its max_rows
        # decoding rows, set by the runner where it can run (int4/int8 or float32 weights,
        # float32, CPU); None: always eager.
        self.fused_decode = None
        # `glue` - quant/glue.py's native RMSNorm / RoPE / SiLU-mul for an eager step's rows,
        # set by the runner for float32 on CPU; None: torch's ops.
        self.glue = None
        # `weight_arena` - on CPU, the one region of 2 MiB pages holding every weight (set by
        # models.build_model after the model is built: huge_pages.py); None elsewhere.
        self.weight_arena = None

        def pack(w):  # a quantized weight in its kernel's layout, float32 in panels where asked (quant/packed.py)
            return quant_pack(w, cfg.dtype, f32_panels)

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint lacks tensor {name!r} needed by {cfg.architecture}")
            return weights.pop(name)

        def maybe(name: str) -> Optional[torch.Tensor]:
            return weights.pop(name, None)

        self.embed = take("model.embed_tokens.weight")
        self.layers: list[Layer] = []
        for i in range(cfg.num_layers):
            a = f"model.layers.{i}.self_attn."
            m = f"model.layers.{i}.mlp."
            biases = [maybe(a + f"{n}_proj.bias") for n in "qkv"]
            self.layers.append(Layer(
                in_norm=take(f"model.layers.{i}.input_layernorm.weight"),
                post_norm=take(f"model.layers.{i}.post_attention_layernorm.weight"),
                w_qkv=pack(cat_rows([take(a + f"{n}_proj.weight") for n in "qkv"])),
                b_qkv=torch.cat(biases) if all(b is not None for b in biases) else None,
                w_o=pack(take(a + "o_proj.weight")), b_o=maybe(a + "o_proj.bias"),
                q_norm=take(a + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=take(a + "k_norm.weight") if cfg.qk_norm else None,
                w_gate_up=pack(cat_rows([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])),
                w_down=pack(take(m + "down_proj.weight"))))
        self.norm = take("model.norm.weight")
        # Quantized: the embedding is packed too (Int4x16 / Int8x16 read rows natively) and
        # a tied head multiplies by the same object; float32 panels: the embedding's rows are
        # looked up in panels too (a tied one in the head's: one copy); under
        # fp16 the head is packed for FBGEMM (a tied head: a second, packed copy of the
        # float16 values) and the embedding stays a float16 tensor.
        self.lm_head = pack(self.embed if cfg.tie_word_embeddings else weights.pop("lm_head.weight", self.embed))
        if not isinstance(self.embed, torch.Tensor) or isinstance(self.lm_head, PackedF32):
            self.embed = self.lm_head if cfg.tie_word_embeddings else pack(self.embed)
        # One float32 table for every position, indexed per step (same bits as computing
        # position * inv_freq on the fly, as transformers does).
        freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos_table, self.sin_table = emb.cos().to(device), emb.sin().to(device)
        if not isinstance(self.lm_head, torch.Tensor):  # packing freed float32 copies: return them
            release_freed_memory()

    @property
    def dtype(self) -> torch.dtype:
        return self.cfg.dtype

    def held_weights(self) -> list:
        """Every weight this model holds, each once (a tied head is the embedding), in the
        order a step reads them."""
        held = [self.embed] + [t for L in self.layers for t in (L.in_norm, L.w_qkv, L.b_qkv, L.q_norm, L.k_norm,
                                                                 L.w_o, L.b_o, L.post_norm, L.w_gate_up, L.w_down)]
        return list({id(t): t for t in held + [self.norm, self.lm_head] if t is not None}.values())

    def weight_bytes(self) -> dict[str, int]:
        """Resident bytes of every weight this model holds, by format (Groups: values +
        per-group scales)."""
        from ferroxmp.gpu_worker.quant import tensor_bytes
        return tensor_bytes(self.held_weights())

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.glue is not None:
            return self.glue.rms(x, w, self.cfg.rms_norm_eps)
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=self.cfg.rms_norm_eps).to(x.dtype)

    def _fused_target(self, tokens: int, attn: AttentionBackend):
        """The fused step's page arguments where it runs this step, else None."""
        fused = self.fused_decode
        return attn.fused_decode_target() if fused is not None and tokens <= fused.max_rows else None

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attn: AttentionBackend) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """forward() and logits() of every token in one fused call -> (final hidden states,
        float32 logits [T, vocab], each token's argmax [T]), views the next step overwrites;
        None where the step does not run fused with its head (the caller runs forward and
        logits then)."""
        at = self._fused_target(input_ids.shape[0], attn)
        if at is None or not self.fused_decode.has_head:
            return None
        return self.fused_decode.with_head(input_ids, positions, *at)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] in the plan's internal order -> final hidden states [T, hidden]."""
        if (at := self._fused_target(input_ids.shape[0], attn)) is not None:
            return self.fused_decode(input_ids, positions, *at)
        cfg = self.cfg
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_w, kv_w = nh * hd, nkv * hd
        glue = self.glue
        if glue is not None:
            pos = positions.to(torch.int64).contiguous()

            def rope(x: torch.Tensor) -> torch.Tensor:  # in place: q and k are this layer's own qkv output
                return glue.rope_(x, pos)
        else:
            cos = self.cos_table[positions].to(self.dtype)[:, None, :]
            sin = self.sin_table[positions].to(self.dtype)[:, None, :]
            half = hd // 2

            def rope(x: torch.Tensor) -> torch.Tensor:
                return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

        h = self.embed_ids(input_ids)
        T = h.shape[0]
        for li, L in enumerate(self.layers):
            x = self._rms(h, L.in_norm)
            qkv = self.linear(x, L.w_qkv, L.b_qkv)
            q = qkv[:, :q_w].view(T, nh, hd)
            k = qkv[:, q_w:q_w + kv_w].view(T, nkv, hd)
            v = qkv[:, q_w + kv_w:].view(T, nkv, hd)
            if L.q_norm is not None:
                q, k = self._rms(q, L.q_norm), self._rms(k, L.k_norm)
            o = attn.forward(li, rope(q), rope(k), v)
            h = h + self.reduce_sum(self.linear(o.reshape(T, q_w), L.w_o, L.b_o))
            x = self._rms(h, L.post_norm)
            gu = self.linear(x, L.w_gate_up)
            a = glue.silu_mul(gu) if glue is not None else \
                F.silu(gu[:, :cfg.intermediate_size]) * gu[:, cfg.intermediate_size:]
            h = h + self.reduce_sum(self.linear(a, L.w_down))
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head on the rows that sample -> float32 [n, vocab]."""
        return self.gather_vocab(self.linear(self._rms(hidden, self.norm), self.lm_head)).float()
