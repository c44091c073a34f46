"""The worker's inference engine: the protocol a worker serves with, and the native engine.

`api` is what a worker asks of any engine (`InferenceEngine`: submit, stream, cancel, load,
held blocks, flush), with the request, result and load types. The native engine (continuous
batching of many requests over one paged KV pool, transformers underneath) is cut by job, as
vLLM's v1 engine is: `core` (the request API and the engine thread), `inputs` (requests into
sequences), `vision` (image and video embeddings), `step` (one forward pass), `outputs` (tokens
into text and results), `loading` (a checkpoint into an engine).

Importing this package imports torch: the web process never does (import-linter's contracts).
"""

from workers.detokenizer import IncrementalDetokenizer
from workers.engine.api import (
    EngineLoad,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    RequestHandle,
    follow,
)
from workers.engine.core import WARM_UP_PROMPT, Engine
from workers.engine.inputs import load_image_directly
from workers.prompt_layout import (
    LLAVA_MODEL_TYPES,
    ImageChangedError,
    ImageInput,
    PromptError,
    VideoInput,
)

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
