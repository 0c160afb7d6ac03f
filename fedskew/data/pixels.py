"""Pixel storage: images are float32 in [0, 1], or uint8 0-255 where the source stores 8-bit pixels.

uint8 is a quarter of the memory (a site of 5,000 RGB images at 224 px: 0.75 GB instead of 3 GB), so
8-bit sources stay uint8 until their pixels are used, and are scaled there by `unit_float`: per batch in
the data loaders and in generator training (the class stays uint8 on the device), per class in the
memorisation audit, per class and channel in the intensity histograms. This module has no dependencies
beyond numpy and torch, so models can use it.
"""

from __future__ import annotations

import numpy as np
import torch


def unit_float(images: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """Images as float32 in [0, 1]: uint8 pixels (0-255) are scaled, float images are returned as they are."""
    if isinstance(images, torch.Tensor):
        return images.float().div_(255.0) if images.dtype == torch.uint8 else images
    return images.astype(np.float32) / np.float32(255.0) if images.dtype == np.uint8 else images
