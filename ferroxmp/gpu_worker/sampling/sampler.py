"""Choose each sampling row's next token from its logits, vectorised over rows.

Job: penalties (repetition: HF semantics over prompt + generated; frequency/presence:
OpenAI semantics over generated), temperature, top-k, top-p, min-p, then a draw; and
the logprobs of what was chosen.

Invariants:
- An all-greedy batch without penalties is one argmax.
- The draw is Gumbel-max with noise that is a pure function of (seed, position, token
  id): a counter-based hash (splitmix64), not a stateful generator. So a row's token
  does not depend on which other rows share the batch, nor on whether the row was
  retracted and re-sent (its positions are the same), nor on the device.
- Filters never remove the most likely token, so a row always has a candidate.
- top_k is clamped to the vocabulary (any larger value means "off"), so no value the
  edge let through can overflow a tensor.
- `sample_rows` isolates rows: if the batch cannot be sampled, each row is sampled
  alone and only the rows that still fail are reported, by index.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ferroxmp.protocol import Logprobs, SamplingParams

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 constants as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
MAX_TOP_LOGPROBS = 20
log = logging.getLogger("ferroxmp.worker")


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (>> is arithmetic on signed tensors)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def _signed64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= (1 << 63) else x


def gumbel_noise(seeds: Sequence[int], positions: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[N, vocab] float64 standard Gumbel noise, a pure function of (seed, position, token)."""
    keys = [_signed64(_signed64(s) * _GOLDEN + p) for s, p in zip(seeds, positions)]
    k = _mix(torch.tensor(keys, dtype=torch.int64, device=device))
    ids = (torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _GOLDEN)[None, :]
    bits = _mix(_mix(k[:, None] + ids))
    u = (_srl(bits, 11).double() + 0.5) * (2.0 ** -53)  # (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))


@dataclass
class RowSample:
    """What the sampler needs of one row."""
    params: SamplingParams
    seed: int
    position: int  # position of the token being sampled (its index in the row's tokens)
    tokens: Optional[Sequence[int]] = None  # prompt + generated; only needed with penalties
    prompt_len: int = 0
    allowed: Optional[torch.Tensor] = None  # grammar bitmask [ceil(vocab/32)] int32 (grammar.py)
    blocked: Sequence[int] = ()  # ids masked this step (EOS and stop ids before min_tokens)

    @property
    def constrained(self) -> bool:
        return self.allowed is not None or bool(self.blocked) or bool(self.params.logit_bias)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] with -inf wherever the row's bit is 0. bitmask [N, ceil(vocab/32)]
    int32 (the grammar engine's layout: token t is bit t % 32 of word t // 32)."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    return logits.masked_fill(~allowed[:, :logits.shape[1]], float("-inf"))


def apply_constraints(logits: torch.Tensor, rows: Sequence[RowSample]) -> torch.Tensor:
    """logit_bias added to the raw logits, then the grammar's mask and min_tokens'
    blocked ids set to -inf. Only constrained rows are touched; the grammar rows' masks
    go to the device in one copy. A grammar that allows nothing but EOS wins over
    min_tokens (blocking both would leave no candidate)."""
    logits = logits.clone()
    dev = logits.device
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            ids = torch.tensor(list(r.params.logit_bias), dtype=torch.int64, device=dev)
            logits[i, ids] += torch.tensor(list(r.params.logit_bias.values()), dtype=logits.dtype, device=dev)
    gram = [i for i, r in enumerate(rows) if r.allowed is not None]
    if gram:
        logits[gram] = apply_bitmask(logits[gram], torch.stack([rows[i].allowed for i in gram]))
    for i, r in enumerate(rows):
        if r.blocked:
            kept = logits[i].index_fill(0, torch.tensor(list(r.blocked), dtype=torch.int64, device=dev),
                                        float("-inf"))
            if r.allowed is None or not bool(torch.isinf(kept).all()):
                logits[i] = kept
    return logits


def apply_penalties(logits: torch.Tensor, rows: Sequence[RowSample]) -> torch.Tensor:
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return logits
    logits = logits.clone()
    n, vocab = len(idx), logits.shape[1]
    gen = torch.zeros(n, vocab, dtype=torch.float32, device=logits.device)
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=logits.device)
    for j, i in enumerate(idx):
        toks = torch.as_tensor(np.asarray(rows[i].tokens if rows[i].tokens is not None else (), dtype=np.int64),
                               device=logits.device)
        seen[j, toks] = True
        gen[j].index_add_(0, toks[rows[i].prompt_len:], torch.ones(len(toks) - rows[i].prompt_len,
                                                                   device=logits.device))
    sub = logits[idx]
    rep = torch.tensor([rows[i].params.repetition_penalty for i in idx], device=logits.device)[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([rows[i].params.frequency_penalty for i in idx], device=logits.device)[:, None]
    pres = torch.tensor([rows[i].params.presence_penalty for i in idx], device=logits.device)[:, None]
    logits[idx] = sub - freq * gen - pres * (gen > 0).float()
    return logits


def _filter(scaled: torch.Tensor, rows: Sequence[RowSample]) -> torch.Tensor:
    """-inf outside each row's top-k / top-p / min-p set (computed on temperature-scaled
    probabilities, as transformers' warpers do)."""
    dev = scaled.device
    top_k = torch.tensor([min(r.params.top_k, scaled.shape[1]) for r in rows], device=dev)
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev, dtype=torch.float32)
    min_p = torch.tensor([r.params.min_p for r in rows], device=dev, dtype=torch.float32)
    probs = torch.softmax(scaled, dim=-1)
    drop = torch.zeros_like(scaled, dtype=torch.bool)
    # Which filters run is decided from the host-side params: asking the device tensors
    # would wait for the GPU (a sync per step).
    if any(r.params.min_p > 0 for r in rows):
        drop |= probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    if any(min(r.params.top_k, scaled.shape[1]) > 0 or r.params.top_p < 1 for r in rows):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(scaled.shape[1], device=dev)[None, :]
        drop_sorted = (top_k[:, None] > 0) & (rank >= top_k[:, None])
        drop_sorted |= (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p[:, None]
        drop_sorted[:, 0] = False
        drop |= torch.zeros_like(drop).scatter(1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first of equal ones; a NaN counts as the
    largest, as in torch). On CPU through numpy: torch's CPU argmax took 43 us over
    SmolLM2's 49,152 logits, numpy's 3 us."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, rows: Sequence[RowSample], top: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [N, vocab] float32 (raw model output) -> chosen token ids [N] int64. top: the
    argmax of each row of `logits` where the step computed it already (the fused step's)."""
    plain = not any(r.params.has_penalties or not r.params.greedy for r in rows)  # argmax of the logits
    constrained = any(r.constrained for r in rows)
    if plain and not constrained and top is not None:
        return top
    if constrained:  # unconstrained batches skip this entirely
        logits = apply_constraints(logits, rows)
    if plain:
        return argmax(logits)
    logits = apply_penalties(logits, rows)
    out = argmax(logits)
    rand = [i for i, r in enumerate(rows) if not r.params.greedy]
    if rand:
        sub = [rows[i] for i in rand]
        temp = torch.tensor([r.params.temperature for r in sub], device=logits.device)[:, None]
        scaled = _filter(logits[rand] / temp, sub)
        noise = gumbel_noise([r.seed for r in sub], [r.position for r in sub], logits.shape[1], logits.device)
        out[rand] = argmax(scaled.double() + noise)
    return out


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSample], faults=None,
                top: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[int, str]]:
    """`sample` over the batch; if that raises, every row alone (a row's draw depends
    on nothing else in the batch, so alone equals batched). Returns the chosen ids and
    {row index: why} for the rows that could not be sampled (their id is meaningless)."""
    try:
        if faults is not None:
            faults.before_sample([r.seed for r in rows])
        return sample(logits, rows, top), {}
    except Exception as e:
        log.warning("sampling a batch of %d rows failed (%s: %s); sampling them one by one",
                    len(rows), type(e).__name__, e)
    chosen = torch.zeros(len(rows), dtype=torch.int64, device=logits.device)
    errors: dict[int, str] = {}
    for i, r in enumerate(rows):
        try:
            if faults is not None:
                faults.before_sample([r.seed])
            chosen[i] = sample(logits[i:i + 1], [r])[0]
        except Exception as e:
            errors[i] = f"sampling failed: {type(e).__name__}: {e}"
    return chosen, errors


def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, top_n: Sequence[int]) -> list[Logprobs]:
    """Chosen token's logprob and the top-n (n <= 20) from log_softmax of the raw logits."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    n_max = min(max(top_n, default=0), MAX_TOP_LOGPROBS)
    top_v, top_i = lp.topk(n_max, dim=-1) if n_max else (None, None)
    chosen_lp = lp.gather(1, chosen[:, None])[:, 0].tolist()
    out = []
    for j, n in enumerate(top_n):
        n = min(n, MAX_TOP_LOGPROBS)
        ids = top_i[j, :n].tolist() if n else []
        vals = top_v[j, :n].tolist() if n else []
        out.append(Logprobs(token_logprob=chosen_lp[j], top_ids=ids, top_logprobs=vals))
    return out
