"""The frontend's name for TextCodec, which lives in ferroxmp/checkpoint/text_codec.py.

The codec is shared text code: the frontend tokenizes and renders chat templates
with it, and the worker's grammar cache reads token bytes from it. It moved below
both (checkpoint is neutral ground) so the worker never imports the frontend
(the import rule in .importlinter); this module keeps the old import path working.
"""
from ferroxmp.checkpoint.text_codec import TextCodec

__all__ = ["TextCodec"]
