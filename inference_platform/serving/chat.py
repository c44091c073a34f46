"""A chat request as serving takes it: already validated by the API (`api.chat_request`).

Plain data, so the serving pipeline reads it without importing the HTTP layer that parses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ImagePart:
    index: int  # position among the request's images, in prompt order
    url: str
    detail: str | None = None
    param: str = "messages"  # where the client wrote it, for errors: messages[i].content[j].image_url


@dataclass
class VideoPart:
    index: int  # position among the request's videos, in prompt order
    url: str
    param: str = "messages"  # where the client wrote it, for errors: messages[i].content[j].video_url


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]  # normalised for the chat template
    images: list[ImagePart]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    videos: list[VideoPart] = field(default_factory=list)
    cache_salt: str | None = None  # vLLM's per-request cache partition, inside the tenant's
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias (ids checked in serving)
    priority: int | None = None  # as the client asked (None: its tenant's default); checked in serving
