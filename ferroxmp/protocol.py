"""Every message that crosses a process boundary, and the one codec for them.

Messages are msgspec Structs in one tagged union, encoded as msgpack — never
pickle, so a foreign or truncated frame cannot execute anything; it raises
`ProtocolError`, which a receiver logs and drops. Token arrays travel as packed
little-endian int32 bytes (`pack_ids` / `unpack_ids`, `unpack_id_list`).

Only deltas travel: a new row carries its token ids and sampling parameters once
(`NewRow`); after that a step names the row, its start position and its length
(`RowStep`). Page lists never travel: they are in the shared page table.
"""
from __future__ import annotations

import os
import sys
from array import array
from typing import TYPE_CHECKING, Any, Optional, Union

import msgspec

if TYPE_CHECKING:
    import numpy as np


class ProtocolError(ValueError):
    """A frame that is not a valid ferroxmp message (truncated, foreign, wrong shape)."""


# Token ids pack through the stdlib's array, not numpy: the frontend and supervisor
# never import numpy (~10 MB resident each); the scheduler and worker unpack to arrays.
assert array("i").itemsize == 4 and array("f").itemsize == 4, "int32 / float32 on the wire"


def le_array(typecode: str, raw: bytes) -> array:
    """Little-endian values on the wire ("i" int32, "f" float32) as an array in this
    machine's order."""
    a = array(typecode)
    a.frombytes(raw)
    if sys.byteorder == "big":
        a.byteswap()
    return a


def le_bytes(a: array) -> bytes:
    """An array's values as the wire's little-endian bytes."""
    if sys.byteorder == "big":
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def pack_ids(ids) -> bytes:
    if hasattr(ids, "astype"):  # a numpy array packs itself, without a Python loop
        return ids.astype("<i4", copy=False).tobytes()
    return le_bytes(array("i", ids))


def _checked(buf: bytes) -> bytes:
    if len(buf) % 4:
        raise ProtocolError(f"token array of {len(buf)} bytes is not a whole number of int32")
    return buf


def unpack_ids(buf: bytes) -> np.ndarray:
    import numpy  # at first use: the processes that call this already have it
    return numpy.frombuffer(_checked(buf), dtype="<i4")


def unpack_id_list(buf: bytes) -> list[int]:
    """The ids as a list, without numpy (the frontend's side of `unpack_ids`)."""
    return le_array("i", _checked(buf)).tolist()


class Grammar(msgspec.Struct, array_like=True):
    """A structured-output constraint: kind "json_object" | "json_schema" | "regex" |
    "ebnf" | "lark"; spec is the schema's JSON text, the regex, the GBNF or llguidance's
    Lark text ("" for json_object). grammar_spec.py reads it."""
    kind: str
    spec: str = ""


class SamplingParams(msgspec.Struct, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: Optional[int] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None: no logprobs; n >= 0: the chosen token's + top-n
    grammar: Optional[Grammar] = None  # structured output: the worker masks what it forbids
    logit_bias: dict[int, float] = {}  # token id -> added to its raw logit (OpenAI's)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many were generated
    # echo + logprobs: each prompt token's logprob and top-n (the first has none). Such a
    # request adopts no cached prefix, so the worker computes every prompt position.
    prompt_logprobs: Optional[int] = None
    # An embedding row (/v1/embeddings): "last" | "mean" | "cls". The worker returns the
    # final-norm hidden state pooled over the prompt (BatchResult.embeddings) with the row's
    # one sampled token, which nobody reads. "mean"/"cls" need every position computed, so
    # such a row adopts no cached prefix (like prompt_logprobs); "last" adopts as usual.
    pooling: Optional[str] = None
    # --reasoning-parser: the grammar applies only once the generated tokens end with these
    # ids (the end of the thinking, e.g. Qwen3's </think>); [] = from the first token.
    grammar_after: list[int] = []

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def constrained(self) -> bool:
        """Anything that edits the logits before sampling (a grammar, a bias, min_tokens)."""
        return self.grammar is not None or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def may_draft(self) -> bool:
        """Speculation (either drafter) may verify drafts for this request: its draw depends on the
        logits, seed and position alone (scheduler and worker both ask this)."""
        return not (self.constrained or self.has_penalties or self.logprobs is not None
                    or self.prompt_logprobs is not None or self.pooling)

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)


# ---- frontend -> scheduler -------------------------------------------------------

class GenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: bytes
    params: SamplingParams
    arrival: float = 0.0  # time.time() when the frontend received it
    # Prefixes are shared only between requests with the same salt (tenant isolation):
    # the salt is part of the radix tree's key, so another tenant's prefix never matches.
    cache_salt: str = ""


class AbortReq(msgspec.Struct, tag=True):
    rid: str
    finish_reason: str = "abort"  # "stop" when the frontend matched a stop string


# ---- scheduler -> frontend -------------------------------------------------------

class Logprobs(msgspec.Struct, array_like=True):
    token_logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RowOut(msgspec.Struct, omit_defaults=True):
    rid: str
    token_ids: bytes = b""
    logprobs: Optional[list[Logprobs]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    error: Optional[str] = None  # set with a refusal; the frontend shows it to the client
    status: int = 200  # HTTP status for a refusal: 400 (never fits), 503 (queue timeout / draining)
    # The request's counts: set on its first RowOut with tokens and on its last (and on
    # a refusal); 0 on the ones between, which carry only new tokens.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float = 0.0
    # Prompt tokens' logprobs since the last RowOut, in order from prompt position 1.
    prompt_logprobs: Optional[list[Logprobs]] = None
    embedding: bytes = b""  # an embedding row's pooled vector: float32 little-endian, not normalized


class Stats(msgspec.Struct, omit_defaults=True):
    running: int = 0
    waiting: int = 0
    pages_total: int = 0
    pages_free: int = 0
    pages_cached: int = 0  # held only by the radix tree
    pages_in_use: int = 0  # held by at least one row
    prompt_tokens: int = 0  # totals since start
    generation_tokens: int = 0
    cached_prompt_tokens: int = 0
    worker_busy_seconds: float = 0.0
    steps: int = 0
    retractions: int = 0
    step_token_budget: int = 0  # tokens a step may hold now (scheduler/step_budget.py)
    # Grammars (PrepareGrammar / GrammarReady): answers from the worker's compiled-grammar
    # cache, requests waiting for their grammar now, and the compiles' durations
    # (counts per GRAMMAR_COMPILE_BUCKETS bound, the last for +Inf, and their sum).
    grammar_cache_hits: int = 0
    grammar_cache_misses: int = 0
    grammar_pending: int = 0
    grammar_compile_counts: list[int] = []
    grammar_compile_seconds: float = 0.0
    # KV tiers: prompt tokens adopted per tier (pool: cached in the pool; host/disk:
    # loaded back from that tier first), and the worker's latest tier figures.
    kv_hit_tokens_pool: int = 0
    kv_hit_tokens_host: int = 0
    kv_hit_tokens_disk: int = 0
    kv_tiers: Optional[KVTierStats] = None
    spec_draft_tokens: int = 0  # --speculative-ngram or --draft-model: tokens drafted and verified
    spec_accepted_tokens: int = 0  # ...and accepted (emitted without a step of their own)


GRAMMAR_COMPILE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TokenOut(msgspec.Struct, tag=True):
    outs: list[RowOut]
    stats: Optional[Stats] = None


# ---- scheduler -> worker ---------------------------------------------------------

class NewRow(msgspec.Struct, array_like=True):
    """A row slot taking a new request: all its known token ids (prompt, plus what it
    generated before a retraction) and its sampling parameters, sent once."""
    row: int
    token_ids: bytes
    params: SamplingParams
    seed: int = 0  # effective seed (the request's, or one the scheduler drew)
    prompt_len: int = 0  # how many of token_ids are prompt (the rest: generated before a retraction); 0 = all


class RowStep(msgspec.Struct, array_like=True):
    """Compute positions [start, start+length) of `row`. A decode step has length 1 and
    its input is the token the worker sampled last for that row. `sample` is false for
    a prefill chunk that does not end the prompt."""
    row: int
    start: int
    length: int
    sample: bool


class ForwardBatch(msgspec.Struct, tag=True):
    batch_id: int
    new_rows: list[NewRow]
    steps: list[RowStep]
    # --speculative-ngram / --draft-model: row -> most draft tokens its decode step may verify;
    # --decode-steps: most further steps it may take in the same call (the scheduler holds
    # pages for that many positions past the step either way).
    spec: dict[int, int] = {}


class BatchResult(msgspec.Struct, tag=True):
    batch_id: int
    rows: bytes = b""  # int32 rows that sampled, in step order
    tokens: bytes = b""  # int32 sampled token per such row
    logprobs: dict[int, Logprobs] = {}  # row -> logprobs, only for rows that asked
    compute_s: float = 0.0
    error: Optional[str] = None  # the batch was refused; nothing was computed
    # Rows this batch could not compute (row -> why). They sampled nothing; the
    # scheduler ends their requests with an error and the batch's other rows go on.
    row_errors: dict[int, str] = {}
    # row -> logprobs of prompt positions [start + 1, min(start + length + 1, prompt_len))
    # of its step in this batch, only for rows whose params ask for prompt_logprobs.
    prompt_logprobs: dict[int, list[Logprobs]] = {}
    # row -> pooled final-norm hidden state (float32 little-endian bytes), for embedding
    # rows (params.pooling) that sampled in this batch, i.e. finished their prompt.
    embeddings: dict[int, bytes] = {}
    # --speculative-ngram / --draft-model: row -> the accepted draft tokens (int32), which follow the
    # row's sampled token in `tokens` (--decode-steps: its further steps' tokens, none drafted);
    # and how many tokens were drafted and accepted.
    spec_tokens: dict[int, bytes] = {}
    spec_drafted: int = 0
    spec_accepted: int = 0


class PrepareGrammar(msgspec.Struct, tag=True):
    """Scheduler -> worker when a constrained request arrives: compile its grammar off
    the batch loop (sampling/grammar_prep.py). The request is planned only after GrammarReady."""
    rid: str
    grammar: Grammar


class GrammarReady(msgspec.Struct, tag=True):
    """Worker -> scheduler: the grammar of `rid` is compiled and cached (error None), or
    cannot be (error: the engine's reason; the scheduler answers 400)."""
    rid: str
    error: Optional[str] = None
    cached: bool = False  # it was in the cache already (a hit)
    compile_s: float = 0.0


# ---- KV tiers (scheduler/tier_index.py mirrors what gpu_worker/kv/tiers.py holds) ----
# A page's key is the 16-byte chain hash of its salt and every token up to its end, so
# a key names a whole prefix: the same key is the same KV, in any tier, on any restart.

KV_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class KVSave(msgspec.Struct, tag=True):
    """Scheduler -> worker: copy these pool pages out now (before any later batch can
    reuse them) and keep them under their keys: in the host tier (an eviction), or on
    disk (`to_disk`: a published page written through, so a restart finds it)."""
    pages: bytes  # int32 pool pages
    keys: list[bytes]
    to_disk: bool = False


class KVLoad(msgspec.Struct, tag=True):
    """Scheduler -> worker: fill these (freshly allocated) pool pages from the tiers."""
    load_id: int
    pages: bytes  # int32
    keys: list[bytes]


class KVLoaded(msgspec.Struct, tag=True):
    """Worker -> scheduler: the first `ok` pages of load `load_id` hold their keys' KV;
    the rest could not be read (missing, torn, checksum): recomputed instead."""
    load_id: int
    ok: int
    tiers: str = ""  # one letter per loaded page: "h" host, "d" disk
    seconds: float = 0.0


class KVTierStats(msgspec.Struct, omit_defaults=True):
    host_bytes: int = 0
    disk_bytes: int = 0
    store_queue: int = 0  # pages waiting for the disk writer
    stores_dropped: int = 0  # a full queue or a failed write: never a blocked step
    load_failures: int = 0  # pages that could not be read back (then recomputed)
    loaded_bytes: int = 0
    stored_bytes: int = 0
    store_counts: list[int] = []  # per KV_SECONDS_BUCKETS bound (+Inf last): one page written
    store_seconds: float = 0.0
    load_counts: list[int] = []  # one KVLoad served
    load_seconds: float = 0.0


class KVTierReport(msgspec.Struct, tag=True):
    """Worker -> scheduler: keys now held by a tier ("h"/"d", one letter per key) and
    keys a tier no longer holds; the scheduler's index changes only through these."""
    stored: list[bytes] = []
    stored_tiers: str = ""
    dropped: list[bytes] = []
    dropped_tiers: str = ""
    stats: Optional[KVTierStats] = None


class KVFlush(msgspec.Struct, tag=True):
    """Scheduler -> worker: empty the host and disk tiers (POST /cache/flush)."""


class FlushCache(msgspec.Struct, tag=True):
    """Frontend -> scheduler: drop every cached prefix in every tier; answered with a
    RowOut for `rid` (finish_reason "stop") once the pool's part is done."""
    rid: str


# ---- handshake and control -------------------------------------------------------

class Ready(msgspec.Struct, tag=True):
    name: str  # "worker", "scheduler", "frontend"
    pid: int
    info: dict[str, Any] = {}


class Shutdown(msgspec.Struct, tag=True):
    reason: str = ""


def endpoints(run_dir: str) -> dict[str, str]:
    """The ipc:// endpoints in a run directory. Each is bound by its reader (PULL)."""
    names = ("scheduler", "worker_results", "frontend", "worker", "supervisor")
    return {n: "ipc://" + os.path.join(run_dir, n + ".sock") for n in names}


Message = Union[GenerateReq, AbortReq, TokenOut, ForwardBatch, BatchResult, PrepareGrammar, GrammarReady,
                KVSave, KVLoad, KVLoaded, KVTierReport, KVFlush, FlushCache, Ready, Shutdown]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(buf: bytes) -> Message:
    try:
        return _decoder.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed message ({len(buf)} bytes): {e}") from None
