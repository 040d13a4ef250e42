"""Tensor parallelism: which slice of each weight a rank holds, and the collectives that
join the slices (torch.distributed: gloo on CPU, NCCL on CUDA).

Split (Megatron-style, as the common servers do):
- attention: q/k/v column-parallel by heads (rank r holds query heads
  [r*nh/N, (r+1)*nh/N) and the KV heads they read); o_proj row-parallel + all-reduce.
  When there are fewer KV heads than ranks (N % nkv == 0), each KV head is REPLICATED
  on the N/nkv ranks whose query heads read it: a rank then holds one KV head.
- MLP: gate/up column-parallel, down row-parallel + all-reduce.
- vocabulary: embedding rows split (ids outside a rank's range look up zeros, then an
  all-reduce) and lm_head rows split (logits all-gathered). The vocabulary is cut in
  ceil(V/N) rows per rank; the last shard is padded with zero rows, trimmed after the
  gather. Sampling happens once, on rank 0, over the gathered logits.
- Replicated: norms, q/k norms (per head_dim), RoPE tables. A row-parallel bias
  (o_proj) is added on rank 0 only, so the all-reduce adds it once.

Invariants: every rank calls the same collectives in the same order (the step channel,
parallel/step.py, makes the other ranks follow rank 0); a rank reads only its slices of a
safetensors file (`get_slice`), never a whole tensor it does not keep.
"""
from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ferroxmp.gpu_worker.loader import ModelConfig, UnsupportedModel, load_weights

Index = tuple  # a tuple of slices into a tensor


def check_divides(cfg: ModelConfig, world: int) -> None:
    """Refuse, by name, a model whose heads or MLP cannot be split `world` ways."""
    why = []
    if cfg.num_heads % world:
        why.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % world and world % cfg.num_kv_heads:
        why.append(f"{cfg.num_kv_heads} KV heads (neither divides the other)")
    if cfg.intermediate_size % world:
        why.append(f"an MLP of {cfg.intermediate_size}")
    if why:
        raise UnsupportedModel(f"--tp {world} cannot split {' and '.join(why)}; use a --tp that divides them")


@dataclass(frozen=True)
class Shard:
    """Rank `rank`'s part of a model of `cfg` split `world` ways."""
    cfg: ModelConfig
    rank: int
    world: int

    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.world

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.world)

    @property
    def first_head(self) -> int:
        return self.rank * self.heads

    @property
    def first_kv_head(self) -> int:
        # Replicated KV: the head this rank's query heads read (head h reads h // group).
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        return self.first_head // group if self.cfg.num_kv_heads < self.world else self.rank * self.kv_heads

    @property
    def ffn(self) -> int:
        return self.cfg.intermediate_size // self.world

    @property
    def vocab_rows(self) -> int:
        return -(-self.cfg.vocab_size // self.world)

    @property
    def vocab_lo(self) -> int:
        return min(self.rank * self.vocab_rows, self.cfg.vocab_size)

    @property
    def vocab_hi(self) -> int:
        return min(self.vocab_lo + self.vocab_rows, self.cfg.vocab_size)

    @property
    def local_config(self) -> ModelConfig:
        """The config the model and KV pool of this rank are built with (vocab stays whole:
        the runner validates and samples over the full vocabulary)."""
        return dataclasses.replace(self.cfg, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                   intermediate_size=self.ffn)

    def index(self, name: str, shape: tuple) -> Optional[Index]:
        """What this rank reads of tensor `name`: a tuple of slices, () for all of it, None
        for nothing (a row-parallel bias on ranks > 0)."""
        hd = self.cfg.head_dim
        rows = lambda lo, n: (slice(lo, lo + n),)  # noqa: E731
        cols = lambda lo, n: (slice(None), slice(lo, lo + n))  # noqa: E731
        part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        is_bias = name.endswith(".bias")
        if part == "q_proj":
            return rows(self.first_head * hd, self.heads * hd)
        if part in ("k_proj", "v_proj"):
            return rows(self.first_kv_head * hd, self.kv_heads * hd)
        if part in ("gate_proj", "up_proj"):
            return rows(self.rank * self.ffn, self.ffn)
        if part in ("o_proj", "down_proj"):
            if is_bias:
                return () if self.rank == 0 else None
            width = self.heads * hd if part == "o_proj" else self.ffn
            first = self.first_head * hd if part == "o_proj" else self.rank * self.ffn
            return cols(first, width)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return rows(self.vocab_lo, self.vocab_hi - self.vocab_lo)
        return ()

    def pad_vocab(self, w: torch.Tensor) -> torch.Tensor:
        """The last vocabulary shard, padded with zero rows to ceil(V/N) (all-gather needs
        equal shards; the padding's logits are cut off after the gather)."""
        missing = self.vocab_rows - w.shape[0]
        if not isinstance(w, torch.Tensor):  # quant.Groups
            return w.pad_rows(missing)
        return w if missing == 0 else torch.cat([w, w.new_zeros(missing, *w.shape[1:])])


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group, and the model's collectives."""
    rank: int
    world: int
    nnodes: int
    group: Any = None  # the model's collectives (the default group: gloo or NCCL)
    ctrl: Any = None  # host-memory messages (the step channel): always gloo

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nnodes

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @classmethod
    def join(cls, rank: int, world: int, nnodes: int, init_method: str, device: torch.device,
             timeout_s: float) -> "TPGroup":
        """Rendezvous with every rank (blocks until all joined)."""
        import torch.distributed as dist
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        ctrl = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        return cls(rank, world, nnodes, dist.group.WORLD, ctrl)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, x: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[n, V/N] per rank -> [n, V] on every rank."""
        import torch.distributed as dist
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def embed(self, ids: torch.Tensor, table, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Vocab-parallel lookup: rows this rank does not hold count as zeros, then sum
        (`table`: float, or quant.Groups read row by row)."""
        from ferroxmp.gpu_worker.models.llama import embedding
        outside = (ids < lo) | (ids >= hi)
        h = embedding((ids - lo).masked_fill(outside, 0), table, dtype)
        return self.all_reduce(h.masked_fill(outside[:, None], 0))

    def agree(self, values: list[int]) -> list[int]:
        """Every rank's `values` -> [the minimum over ranks of each]; raises when any
        position but the first differs (the ranks were started with different flags)."""
        import torch.distributed as dist
        mine = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.ctrl)
        for r, p in enumerate(parts):
            if p[1:].tolist() != values[1:]:
                raise RuntimeError(f"rank {r} was started with a different model or flags "
                                   f"({p[1:].tolist()} vs {values[1:]}); every node must get the same")
        return [int(x) for x in torch.stack(parts).min(0).values]

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier(group=self.ctrl)

    def close(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer is already gone; nothing to hand back
                pass


def build_model(model_path: str, cfg: ModelConfig, device: torch.device, tp: TPGroup,
                quantization: str = "none"):
    """This rank's shard of the model, its hooks joined through `tp`; returns (model,
    local config). Safetensors are read slice by slice; a GGUF is dequantized whole and
    then sliced (llama.cpp's block quantization has no per-row reader here). With
    quantization='int8' each weight is quantized whole, then sliced: a shard holds
    exactly the int8 values and row scales tp=1 holds."""
    from ferroxmp.gpu_worker.models import build_model as build
    shard = Shard(cfg, tp.rank, tp.world)
    weights = load_weights(model_path, device, cfg.dtype, select=shard.index, quantization=quantization)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            weights[name] = shard.pad_vocab(weights[name])
    model = build(shard.local_config, weights, device)
    lo, hi = shard.vocab_lo, shard.vocab_hi
    model.reduce_sum = tp.all_reduce
    model.gather_vocab = lambda x: tp.gather_vocab(x, cfg.vocab_size)
    model.embed_ids = lambda ids: tp.embed(ids, model.embed, lo, hi, cfg.dtype)
    return model, shard.local_config

