"""Foundation: every protocol message round-trips, malformed frames raise one error
type, the CLI lists every flag and refuses bad values before anything starts."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import msgspec
import pytest

from ferroxmp import protocol as P
from ferroxmp.config import ServerArgs

SAMPLES = [
    P.GenerateReq("a", P.pack_ids([1, 2, 3]), P.SamplingParams(max_tokens=5, temperature=0.0, seed=7,
                                                               stop_token_ids=[9], logprobs=2), 1.5),
    P.AbortReq("a", "stop"),
    P.TokenOut([P.RowOut("a", P.pack_ids([4]), [P.Logprobs(-0.5, [4, 5], [-0.5, -1.0])], "length",
                         prompt_tokens=3, cached_tokens=2)], P.Stats(running=1, pages_total=9)),
    P.TokenOut([P.RowOut("b", finish_reason="error", error="too long", status=400)]),
    P.ForwardBatch(3, [P.NewRow(0, P.pack_ids([1, 2]), P.SamplingParams(), 11)], [P.RowStep(0, 0, 2, True)]),
    P.BatchResult(3, P.pack_ids([0]), P.pack_ids([42]), {0: P.Logprobs(-0.1)}, 0.01),
    P.BatchResult(4, error="unknown row 9"),
    P.Ready("worker", 123, {"num_pages": 10, "eos_token_ids": [1, 2], "sliding_window": None}),
    P.Shutdown("bye"),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    assert P.decode(P.encode(msg)) == msg


def test_token_arrays_are_packed_int32():
    """The wire is little-endian int32 (the oracle: struct's "<i"), packed from a list (the
    stdlib's array: the frontend's way) or a numpy array alike, and read back as a numpy
    array (scheduler, worker) or a list (frontend); a length that is not whole int32s is a
    ProtocolError either way."""
    import struct
    import numpy as np
    ids = [0, 1, -7, 2**31 - 1, 151_000]
    wire = struct.pack(f"<{len(ids)}i", *ids)
    assert P.pack_ids(ids) == P.pack_ids(np.array(ids, dtype=np.int64)) == wire
    assert P.unpack_ids(wire).tolist() == P.unpack_id_list(wire) == ids
    for unpack in (P.unpack_ids, P.unpack_id_list):
        with pytest.raises(P.ProtocolError):
            unpack(wire[:-1])


@pytest.mark.parametrize("frame", [b"", b"\x00\x01garbage", P.encode(SAMPLES[0])[:-2],
                                   msgspec.msgpack.encode({"type": "Nope", "x": 1}),
                                   msgspec.msgpack.encode({"type": "GenerateReq", "rid": 5})])
def test_a_malformed_frame_raises_the_codec_error(frame):
    """Truncated, foreign or mistyped frames must raise ProtocolError (which
    receivers log and drop), never another exception that would kill them."""
    with pytest.raises(P.ProtocolError):
        P.decode(frame)


def test_pickle_never_decodes():
    import pickle
    with pytest.raises(P.ProtocolError):
        P.decode(pickle.dumps(SAMPLES[1]))


def _serve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ferroxmp.cli", "serve", *argv],
                          capture_output=True, text=True, timeout=60)


def test_serve_help_lists_every_flag():
    out = _serve("--help")
    assert out.returncode == 0
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in out.stdout, f.name
    for flag in ("--model", "--served-model-name", "--host", "--port", "--device", "--dtype",
                 "--page-size", "--kv-pages", "--kv-cache-gb", "--mem-fraction",
                 "--max-running-requests", "--max-batch-tokens", "--max-model-len", "--queue-timeout",
                 "--disable-radix-cache", "--disable-overlap", "--swa-release-interval", "--tp",
                 "--api-key", "--log-level"):
        assert flag in out.stdout, flag


@pytest.mark.parametrize("argv,flag", [
    (["--port", "70000"], "--port"), (["--page-size", "3"], "--page-size"),
    (["--kv-pages", "0"], "--kv-pages"), (["--mem-fraction", "1.5"], "--mem-fraction"),
    (["--max-batch-tokens", "0"], "--max-batch-tokens"), (["--device", "tpu"], "--device"),
    (["--model", "/no/such/folder"], "--model"), (["--queue-timeout", "-1"], "--queue-timeout"),
    (["--port", "abc"], "--port"), (["--tp", "0"], "--tp"), (["--tp", "2", "--nnodes", "2"], "--dist-init-addr"),
    (["--tp", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "--nnodes"),
])
def test_a_bad_flag_value_exits_non_zero_naming_the_flag(argv, flag):
    out = _serve(*argv)
    assert out.returncode != 0
    assert flag in out.stderr and "Traceback" not in out.stderr
