"""Lets PyPI's torchvision import beside the CPU torch in the vLLM worker's virtualenv.

PyPI's torchvision wheel links CUDA libraries; beside `torch==2.13.0+cpu` its compiled ops
(`torchvision/_C.so`) do not load, and `import torchvision` then fails registering fake kernels
for two ops that were never defined ("operator torchvision::nms does not exist"). transformers'
Qwen2-VL image processor imports torchvision at the top, so vLLM could not serve Qwen2-VL.

Before torchvision is first imported, this defines those two op schemas when its compiled ops
cannot load. Image preprocessing needs neither op; calling one still fails, as it should. The
make target `vllm` copies this file into the virtualenv's site-packages; nothing else loads it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def _define_missing_ops(package_dir: str) -> None:
    import glob

    import torch

    compiled = glob.glob(f"{package_dir}/_C*.so")
    try:
        if compiled:
            torch.ops.load_library(compiled[0])
            return  # the real ops are there (a build that matches this torch)
    except (OSError, RuntimeError):
        pass
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS.values():
        library.define(schema)
    _keep.append(library)  # a Library frees its definitions when collected


_keep: list[Any] = []


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once, and the real finder answers from here on
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            _define_missing_ops(next(iter(spec.submodule_search_locations)))
        return spec


sys.meta_path.insert(0, _BeforeTorchvision())
