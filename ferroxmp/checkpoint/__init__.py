"""Checkpoint files that more than one process reads: GGUF files (metadata, tensors,
tokenizer), the text codec (tokenizer + chat template, text_codec.py) and the
default model's location.

Neutral ground: the frontend (tokenizer, chat template) and the worker (config,
weights) both import this package; it imports nothing of ferroxmp's processes,
and nothing here imports torch, so the frontend stays light.
"""
from __future__ import annotations

import os


def is_gguf(path: str) -> bool:
    """A model path names a GGUF file (not a Hugging Face folder)."""
    return path.lower().endswith(".gguf") and os.path.isfile(path)
