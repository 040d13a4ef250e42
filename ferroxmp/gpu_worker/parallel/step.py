"""The step channel of tensor parallelism: rank 0 tells every other rank what to compute
(the other ranks' process, which follows it, is parallel/rank.py).

Rank 0 is the worker the scheduler talks to (worker.py): it receives each ForwardBatch,
validates it, resolves every row's input tokens and plans attention, then broadcasts the
STEP and runs the forward with the others. Followers keep no row state (no tokens, no
sampler, no grammar): they are told which positions to compute and which to put through
lm_head, so they cannot diverge from rank 0. (Replaying the ForwardBatch on every rank
would need the same sampled tokens, failed rows and grammar refusals everywhere, and one
difference would make the ranks call different collectives: a hang.)

Messages (int64 arrays over the gloo group; one broadcast when a message fits CAP words):
- STEP [R, T, with_pages, F] + (row, start, length) x R in internal order + T token ids
  + F rows whose slot rank 0's attention backend was told to forget since the last STEP
  (a new request in the slot: backends may keep a row's K/V between steps)
  + when the group spans nodes: each row's first page index, page count, and the pages.
  Ranks on node 0 read page lists from the shared-memory page table like rank 0 (the
  entries a step reads do not change while it is in flight); ranks on other nodes have
  no shared memory and rebuild those entries from the message. One node: no page travels.
- LOGITS [indices]: lm_head on those positions of the last STEP (vocab shard + all-gather).
- TICK: sent on every idle poll of rank 0 (0.5 s): gloo's timeout never fires on an idle
  server, and a follower notices a dead supervisor.
- STOP: exit 0.

Failure: a collective that loses a peer raises; the rank exits non-zero and its
supervisor tears the server down. Rank 0 treats an exception inside a step as fatal
(the others may be inside a collective it will never join).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ferroxmp.config import ServerArgs
from ferroxmp.gpu_worker.attention import StepPlan
from ferroxmp.gpu_worker.loader import ModelConfig, resolve_device
from ferroxmp.gpu_worker.parallel.group import TPGroup, build_model, check_divides

STEP, LOGITS, TICK, STOP = 1, 2, 3, 4
CAP = 256  # int64 words broadcast at once; a longer message takes a second broadcast


class Channel:
    def __init__(self, tp: TPGroup) -> None:
        self.group = tp.ctrl
        self.buf = torch.zeros(CAP, dtype=torch.int64)

    def send(self, kind: int, payload: Optional[np.ndarray] = None) -> None:
        import torch.distributed as dist
        n = 0 if payload is None else len(payload)
        head = min(n, CAP - 2)
        self.buf[0], self.buf[1] = kind, n
        if head:
            self.buf[2:2 + head] = torch.from_numpy(payload[:head])
        dist.broadcast(self.buf, 0, group=self.group)
        if n > head:
            dist.broadcast(torch.from_numpy(np.ascontiguousarray(payload[head:])), 0, group=self.group)

    def recv(self) -> tuple[int, np.ndarray]:
        import torch.distributed as dist
        dist.broadcast(self.buf, 0, group=self.group)
        kind, n = int(self.buf[0]), int(self.buf[1])
        head = min(n, CAP - 2)
        out = np.empty(n, np.int64)
        out[:head] = self.buf[2:2 + head].numpy()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.int64)
            dist.broadcast(rest, 0, group=self.group)
            out[head:] = rest.numpy()
        return kind, out


def encode_step(plan: StepPlan, ids: np.ndarray, with_pages: bool, forgotten: list[int]) -> np.ndarray:
    parts = [np.array([len(plan.rows), len(ids), int(with_pages), len(forgotten)], np.int64),
             np.stack([plan.rows, plan.starts, plan.lengths], 1).ravel(), ids, np.array(forgotten, np.int64)]
    if with_pages:
        parts += [plan.first_page, np.diff(plan.kv_indptr), plan.kv_pages]
    return np.concatenate([np.asarray(p, np.int64) for p in parts])


def decode_step(data: np.ndarray, table_shape: tuple[int, int]):
    """-> (triples, ids, forgotten rows, table or None): the table holds exactly the
    entries the step reads."""
    R, T, with_pages, F = (int(x) for x in data[:4])
    at = 4 + 3 * R
    triples = [tuple(t) for t in data[4:at].reshape(R, 3).tolist()]
    ids, forgotten = data[at:at + T], data[at + T:at + T + F].tolist()
    if not with_pages:
        return triples, ids, forgotten, None
    rest = data[at + T + F:]
    first, count, pages = rest[:R], rest[R:2 * R], rest[2 * R:]
    row_of = np.repeat(np.arange(R), count)
    col = first[row_of] + np.arange(len(pages)) - np.repeat(np.cumsum(count) - count, count)
    table = np.zeros(table_shape, np.int32)
    table[np.array([t[0] for t in triples])[row_of], col] = pages
    return triples, ids, forgotten, table


def rank_device(name: str, local_rank: int) -> torch.device:
    device = resolve_device(name)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return device


def join(t: dict, rank: int, device: torch.device, sa: ServerArgs, cfg: ModelConfig) -> TPGroup:
    """t: launch.json's "tp" ({"init_method", "world", "nnodes"}, written by the supervisor)."""
    check_divides(cfg, t["world"])  # every rank refuses the same model, by name
    # gloo's own timeout: far beyond any step (a step must end within --stall-timeout).
    return TPGroup.join(rank, t["world"], t["nnodes"], t["init_method"], device,
                        timeout_s=max(600.0, 4 * sa.stall_timeout))


def agree_pages(tp: TPGroup, num_pages: int, sa: ServerArgs, cfg: ModelConfig, max_pages_per_row: int) -> int:
    """The smallest rank's page count; refuses ranks started with another model or shape."""
    return tp.agree([num_pages, sa.page_size, sa.max_running_requests, max_pages_per_row,
                     cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size, cfg.hidden_size])[0]


class Leader:
    """Rank 0's side: what the runner calls (send_step, send_logits) and the worker loop
    (tick, stop)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.channel = Channel(tp)
        self.with_pages = tp.nnodes > 1
        self.busy = False  # a step began and the worker has not yet called done()
        self.forgotten: list[int] = []  # rows rank 0's backend forgot since the last STEP

    def attach(self, attn) -> None:
        """Record every `forget(row)` the runner makes on rank 0's attention backend (the
        followers' backends must forget the same rows), then wait until every rank loaded."""
        forget = attn.forget

        def forget_everywhere(row: int) -> None:
            self.forgotten.append(int(row))
            forget(row)
        attn.forget = forget_everywhere  # an instance attribute: this backend object only
        self.tp.barrier()

    def build_model(self, model_path: str, cfg: ModelConfig, device: torch.device, quantization: str = "none"):
        return build_model(model_path, cfg, device, self.tp, quantization)

    def send_step(self, plan: StepPlan, ids: np.ndarray) -> None:
        self.busy = True
        self.channel.send(STEP, encode_step(plan, ids, self.with_pages, self.forgotten))
        self.forgotten = []

    def send_logits(self, index) -> None:
        if isinstance(index, slice):
            arr = np.arange(index.start, index.stop, dtype=np.int64)
        else:
            arr = np.asarray(index.tolist() if isinstance(index, torch.Tensor) else index, np.int64)
        self.channel.send(LOGITS, arr)

    def done(self) -> None:
        self.busy = False

    def tick(self) -> None:
        self.channel.send(TICK)

    def stop(self) -> None:
        """Tell the others to exit, unless a step was cut short (they are inside a
        collective rank 0 will not finish: they find out when its connections close)."""
        if not self.busy:
            try:
                self.channel.send(STOP)
            except RuntimeError:
                pass
        self.tp.close()
