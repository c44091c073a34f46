"""The worker's inference engine: the protocol a worker serves with, and the native engine.

`api` is what a worker asks of any engine (`InferenceEngine`: submit, stream, cancel, load,
held blocks, flush), with the request, result and load types. The native engine (continuous
batching of many requests over one paged KV pool, transformers underneath) is cut by job, as
vLLM's v1 engine is: `core` (the request API and the engine thread), `inputs` (requests into
sequences), `vision` (image and video embeddings), `step` (one forward pass), `outputs` (tokens
into text and results), `loading` (a checkpoint into an engine).

The native engine's names load on first use (PEP 562): `workers.engine.api` and `counters` import
no torch, so an engine without a model (`workers.sim_engine`) uses them and never loads torch;
`from workers.engine import Engine` imports torch. The web process imports none of it
(import-linter's contracts).
"""

from __future__ import annotations

import importlib
from typing import Any

from workers.engine.api import (
    EngineLoad,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    RequestHandle,
    follow,
)

# Name -> the module that defines it, imported when the name is first asked for.
_LAZY = {
    "IncrementalDetokenizer": "workers.detokenizer",
    "WARM_UP_PROMPT": "workers.engine.core",
    "Engine": "workers.engine.core",
    "load_image_directly": "workers.engine.inputs",
    "LLAVA_MODEL_TYPES": "workers.prompt_layout",
    "ImageChangedError": "workers.prompt_layout",
    "ImageInput": "workers.prompt_layout",
    "PromptError": "workers.prompt_layout",
    "VideoInput": "workers.prompt_layout",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "LLAVA_MODEL_TYPES",
    "WARM_UP_PROMPT",
    "Engine",
    "EngineLoad",
    "GenerationRequest",
    "GenerationResult",
    "ImageChangedError",
    "ImageInput",
    "IncrementalDetokenizer",
    "InferenceEngine",
    "PromptError",
    "RequestHandle",
    "VideoInput",
    "follow",
    "load_image_directly",
]
