"""What SGLang needs to import on this CI's CPU-only torch (tests only; import before sglang).

SGLang imports ``torchvision.transforms`` at import time (``sglang.srt.configs``). PyPI's
torchvision wheels are CUDA builds: with the CPU build of torch their C extension does not load,
and torchvision then fails on registering fake kernels for ``torchvision::nms`` and ``qnms``,
ops that extension would have defined. When (and only when) the extension does not load, this
defines those two op schemas, so that torchvision (and so SGLang) imports; nothing in kvproto's
tests calls a torchvision op. With a CUDA torch nothing is done.
"""

from __future__ import annotations

import glob
import importlib.util
import os

_done = False


def prepare() -> None:
    """Idempotent: HF offline (SGLang reads a local model config only) and the torchvision ops."""
    global _done
    if _done:
        return
    _done = True
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    libs = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so"))
    try:
        if libs:
            torch.ops.load_library(libs[0])
            return
    except OSError:
        pass
    for op in ("nms", "qnms"):
        torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
