"""The drafter of `--draft-model`: a small model of the target's tokenizer proposes each
drafting row's next tokens, which the runner verifies as it verifies prompt-lookup drafts.

Job: hold the draft model, its KV and its attention backend; per step, `sync` it with the
step the target computes and `propose` up to k greedy tokens for each row given a budget.

Why the draft's KV lives in the target's pages: its KV tensors have the target pool's
num_pages and page_size and are indexed through the same shared page table, so page p
holds the same token positions in both models. A prefix adopted from the radix tree, a
chunk computed steps ago, a page another request published: each holds the draft's KV
exactly where it holds the target's, with no bookkeeping of its own, provided that

  in every step the draft writes exactly the positions the target writes, over the
  same tokens.

So `sync` computes every step of the batch (prefill chunks, decode rows, embedding rows:
any page may be adopted later), and a drafting row whose step ends at position e (its
last known token) runs k more single-token forwards, batched over the drafting rows:
forward j feeds d_j at e + j, whose argmax is d_{j+1}. The target verifies d_1..d_k at
e + 1..e + k, so the draft writes those too; the k-th forward (d_k at e + k) only writes
its KV (nobody reads its logits), for the case where every draft is accepted.

Rejected drafts: positions past the accepted ones hold garbage in both models. The
row's next step starts at the first of them (its last known token) and rewrites it,
and every later position is rewritten by the step that feeds it, before any query reads
it (a query at position p reads keys <= p only), in the draft as in the target.

A draft that fails (a bug, memory) only costs drafts: the step runs without them.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from ferroxmp.gpu_worker.attention import PlanError, make_backend
from ferroxmp.gpu_worker.kv.pool import KVPool
from ferroxmp.gpu_worker.loader import ModelConfig, UnsupportedModel, load_config, load_weights
from ferroxmp.gpu_worker.models import build_model
from ferroxmp.gpu_worker.quant import describe_bytes, resolve_mode
from ferroxmp.protocol import RowStep
from ferroxmp.token_ids import TokenIds

log = logging.getLogger("ferroxmp.worker")


def check_fits(draft: ModelConfig, target: ModelConfig, path: str) -> None:
    """Refuse a draft that cannot follow the target: another vocabulary (its ids would mean
    other tokens), a shorter context, or a wider attention window than the target's (the
    scheduler frees pages outside the target's window; the draft would read them)."""
    def refuse(why: str, field: str) -> None:
        raise UnsupportedModel(f"--draft-model {path}: {why}", field)

    if draft.vocab_size != target.vocab_size:
        refuse(f"its vocabulary has {draft.vocab_size} tokens and the target's {target.vocab_size}; a draft "
               "model must share the target's tokenizer", "vocab_size")
    if draft.max_position_embeddings < target.max_position_embeddings:
        refuse(f"its context ({draft.max_position_embeddings}) is shorter than the target's "
               f"({target.max_position_embeddings})", "max_position_embeddings")
    if target.sliding_window is not None and (draft.sliding_window or 1 << 62) > target.sliding_window:
        refuse(f"it attends beyond the target's sliding window ({draft.sliding_window} > "
               f"{target.sliding_window})", "sliding_window")


class DraftModel:
    def __init__(self, path: str, target: ModelConfig, device: torch.device, dtype: str = "auto",
                 quantization: str = "auto", attention: str = "auto"):
        self.config = load_config(path, dtype)
        check_fits(self.config, target, path)
        self.path, self.device, self._attention = path, device, attention
        # Not under --deterministic's rule: a draft is verified by the target, so its bits
        # never reach the output; only how many drafts are accepted depends on them.
        self.quantization = resolve_mode(quantization, path, device)
        weights = load_weights(path, device, self.config.dtype, quantization=self.quantization)
        self.model = build_model(self.config, weights, device)
        self.kv: Optional[KVPool] = None
        self.attn = None

    def attach(self, num_pages: int, page_size: int, layout: str) -> None:
        """KV tensors with the target pool's pages (dropping any earlier ones first)."""
        self.kv = self.attn = None
        self.kv = KVPool.for_model(self.config, num_pages, page_size, self.device, layout)
        self.attn = make_backend(self.kv, self.config.sliding_window, self.device, self._attention,
                                 num_heads=self.config.num_heads)
        log.info("draft model memory: %s", describe_bytes(self.model.weight_bytes(), self.kv.nbytes))

    def forget(self, row: int) -> None:
        self.attn.forget(row)

    def reset(self) -> None:
        self.attn.reset()

    def idle(self) -> None:
        self.attn.idle()

    def memory_info(self) -> dict:
        weights = self.model.weight_bytes()
        return {"model": self.path, "quantization": self.quantization, "weight_bytes": sum(weights.values()),
                "weight_bytes_by_format": weights, "kv_bytes": self.kv.nbytes}

    def propose(self, steps: list[RowStep], tokens: dict[int, TokenIds], budget: dict[int, int],
                table: np.ndarray) -> dict[int, list[int]]:
        """Sync with the step, then row -> budget[row] drafted tokens for the rows in
        `budget` (each a sampling step ending at the row's last known token)."""
        try:
            drafts = self.sync(steps, tokens, budget, table)
            end = {s.row: s.start + s.length for s in steps if s.row in drafts}  # the position of d_1
            for j in range(1, max(budget.values(), default=0) + 1):
                rows = [r for r in drafts if budget[r] >= j]
                read = [i for i, r in enumerate(rows) if budget[r] > j]  # the k-th forward only writes KV
                nxt = self._forward([(r, end[r] + j - 1, 1) for r in rows],
                                    [np.array(drafts[r][j - 1:j], np.int32) for r in rows], table, read)
                for i, t in zip(read, nxt):
                    drafts[rows[i]].append(t)
            return drafts
        except PlanError:
            raise  # a bad page: the target's plan refuses the batch as well
        except Exception as e:  # noqa: BLE001 - the draft KV of this step may be partial: costs drafts, not output
            log.warning("the draft model failed (%s: %s); this step runs without drafts", type(e).__name__, e)
            self.reset()
            return {}

    def sync(self, steps: list[RowStep], tokens: dict[int, TokenIds], budget: dict[int, int],
             table: np.ndarray) -> dict[int, list[int]]:
        """One forward over every step of the batch, as the target computes it; returns
        row -> [d_1] (the argmax at its last position) for the rows in `budget`."""
        read = [i for i, s in enumerate(steps) if s.row in budget]
        firsts = self._forward([(s.row, s.start, s.length) for s in steps],
                               [tokens[s.row][s.start:s.start + s.length] for s in steps], table, read)
        return {steps[i].row: [t] for i, t in zip(read, firsts)}

    def _forward(self, triples: list[tuple[int, int, int]], pieces: list[np.ndarray], table: np.ndarray,
                 read: list[int]) -> list[int]:
        """The draft over `triples` (row, start, length) fed `pieces` (each one's tokens);
        the argmax of the logits at the last position of the steps indexed by `read`."""
        plan = self.attn.plan(triples, table)
        ids = np.concatenate([pieces[i] for i in plan.order]).astype(np.int64)
        with torch.inference_mode():
            hidden = self.model.forward(torch.from_numpy(ids).to(self.device),
                                        torch.from_numpy(plan.positions).to(self.device), self.attn)
            if not read:
                return []
            index = torch.tensor([plan.last_index[i] for i in read], device=self.device)
            return self.model.logits(hidden[index]).argmax(dim=-1).tolist()
