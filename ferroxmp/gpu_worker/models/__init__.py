"""Model modules by architecture name: one DecoderLM serves all four supported
architectures (they differ by flags in ModelConfig and by the tensors present)."""
from __future__ import annotations

import torch

from ferroxmp.gpu_worker.huge_pages import move_weights
from ferroxmp.gpu_worker.loader import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModel
from ferroxmp.gpu_worker.models.llama import DecoderLM

MODEL_CLASSES = {arch: DecoderLM for arch in SUPPORTED_ARCHITECTURES}


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                f32_panels: bool = False) -> DecoderLM:
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise UnsupportedModel(f"architecture {cfg.architecture!r} is not supported; "
                               f"ferroxmp runs {', '.join(MODEL_CLASSES)}")
    model = cls(cfg, weights, device, f32_panels)  # float32 weights as groups.c's panels (quant/packed.py)
    # On CPU every step streams the weights: in 2 MiB pages, not 4 KiB ones (huge_pages.py)
    model.weight_arena = move_weights(model) if device.type == "cpu" else None
    return model
