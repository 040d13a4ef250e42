"""Run one function in a forked child and take back its JSON answer.

Why: some one-off work imports libraries or reads files whose memory would stay
resident for a server process's whole life. Checking a checkpoint imports gguf and
tokenizers and reads the whole file, removing dead servers' segments imports numpy
(the supervisor: ~27 + 15 MB of a 65 MB process); building a GGUF file's tokenizer
imports numpy and gguf (the frontend: ~12 MB). In a child, that memory goes back to
the system when the child exits; only the answer crosses, through a pipe.
"""
from __future__ import annotations

import json
import logging
import os
import traceback


def in_child(fn, *fn_args):
    """fn(*fn_args) in a forked child; its JSON result, or its OSError / ValueError again
    as a ValueError with the same message. Call it before any thread or ZMQ context
    exists (a fork copies only the calling thread)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, never return into the caller
        code = 1
        try:
            os.close(r)
            try:
                out = {"result": fn(*fn_args)}
            except (OSError, ValueError) as e:
                out = {"error": str(e) or type(e).__name__}
            with os.fdopen(w, "w") as f:
                json.dump(out, f)
            code = 0
        except BaseException:  # a bug: its traceback on stderr, no answer (os._exit drops it)
            traceback.print_exc()
        finally:
            logging.shutdown()
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        answer = f.read()
    _, status = os.waitpid(pid, 0)
    if not answer:
        raise ValueError(f"the forked child ended without an answer (exit code {os.waitstatus_to_exitcode(status)})")
    out = json.loads(answer)
    if "error" in out:
        raise ValueError(out["error"])
    return out["result"]
