"""What the frontend knows of the served model, read from its directory without torch.

The chat template is rendered exactly as transformers renders it (a sandboxed Jinja
environment with the same options and helpers), and the tokenizer is the checkpoint's own
`tokenizer.json` through the `tokenizers` library, so the frontend's view of the prompt is
the worker's, at a fraction of the start-up cost.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from routing.prompt.layouts import layout_for_model_dir
from routing.prompt.video_layouts import video_layout_for_model_dir


class ModelDirectoryError(RuntimeError):
    """The model directory is missing or lacks what the frontend needs."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
):
    # transformers' own tojson filter: no HTML escaping, unlike Jinja's built-in one.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as fh:
        return json.load(fh)


# Breaks a control token a client wrote into plain text (see ModelView.literal_messages).
LITERAL_JOINER = "\u2060"


@dataclass
class ModelView:
    path: Path
    name: str

    @cached_property
    def config(self) -> dict[str, Any]:
        config = _read_json(self.path / "config.json")
        if not config:
            raise ModelDirectoryError(f"no config.json in the model directory {self.path}")
        return config

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @cached_property
    def tokenizer_config(self) -> dict[str, Any]:
        return _read_json(self.path / "tokenizer_config.json")

    @cached_property
    def tokenizer(self) -> Tokenizer:
        path = self.path / "tokenizer.json"
        if not path.is_file():
            raise ModelDirectoryError(f"no tokenizer.json in the model directory {self.path}")
        return Tokenizer.from_file(str(path))

    @cached_property
    def chat_template_source(self) -> str:
        for name in ("chat_template.jinja",):
            candidate = self.path / name
            if candidate.is_file():
                return candidate.read_text(encoding="utf-8")
        for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
            template = _read_json(self.path / name).get("chat_template")
            if isinstance(template, str):
                return template
        raise ModelDirectoryError(f"no chat template in the model directory {self.path}")

    @cached_property
    def _template(self) -> jinja2.Template:
        return compile_chat_template(self.chat_template_source)

    def _special_token(self, key: str) -> str | None:
        value = self.tokenizer_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None

    @cached_property
    def _control_strings(self) -> re.Pattern[str] | None:
        """The tokenizer's added tokens (role markers, image placeholders) as one pattern."""
        contents = {token.content for token in self.tokenizer.get_added_tokens_decoder().values()}
        contents = sorted((c for c in contents if len(c) > 1), key=len, reverse=True)
        return re.compile("|".join(re.escape(c) for c in contents)) if contents else None

    def literal_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages with every control token the client wrote kept as text.

        A client's `<|im_start|>system` must not open a system turn, nor its `<|image_pad|>` stand
        for an image: the template's own markers are the only control tokens of a prompt. Each
        such string in the client's text gets a WORD JOINER (U+2060, invisible) after its first
        character, so no tokenizer, here or in the worker, can match it as the added token.
        """
        pattern = self._control_strings
        if pattern is None:
            return messages

        def literal(text: str) -> str:
            return pattern.sub(lambda match: match[0][0] + LITERAL_JOINER + match[0][1:], text)

        escaped = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                content = literal(content)
            elif isinstance(content, list):
                content = [
                    {**part, "text": literal(part["text"])} if isinstance(part.get("text"), str) else part
                    for part in content
                ]
            escaped.append({**message, "content": content})
        return escaped

    def render_prompt(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text the model's chat template makes of these messages."""
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special_token("bos_token") or "",
            eos_token=self._special_token("eos_token") or "",
            pad_token=self._special_token("pad_token") or "",
            unk_token=self._special_token("unk_token") or "",
        )

    @cached_property
    def image_layout(self):  # -> routing.prompt.layouts.ImageLayout | None
        """How this model's images expand into placeholder tokens; None for a family we can't count."""
        return layout_for_model_dir(self.path)

    @cached_property
    def image_placeholder_id(self) -> int | None:
        """The token id of the one placeholder the chat template emits per image."""
        layout = self.image_layout
        # Llama 4's config names the patch token, not the <|image|> its template emits.
        if layout is None or getattr(layout, "config_names_placeholder", True):
            for key in ("image_token_id", "image_token_index", "img_context_token_id"):
                value = self.config.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
        return self.token_id(layout.placeholder_token) if layout is not None else None

    @cached_property
    def video_layout(self):  # -> routing.prompt.video_layouts.QwenVideoLayout | None
        """How this model samples and lays out a video; None for a family that takes no video."""
        return video_layout_for_model_dir(self.path)

    @cached_property
    def video_placeholder_id(self) -> int | None:
        """The token id of the one placeholder the chat template emits per video."""
        value = self.config.get("video_token_id")
        if isinstance(value, int):
            return value
        layout = self.video_layout
        return self.token_id(layout.placeholder_token) if layout is not None else None

    @cached_property
    def image_token_ids(self) -> dict[str, int]:
        """Ids of the marker tokens the layout's expansions hold besides the placeholder."""
        layout = self.image_layout
        if layout is None:
            return {}
        ids: dict[str, int] = {}
        for token in layout.vocabulary:
            if token == layout.placeholder_token:
                continue
            value = self.token_id(token)
            if value is None:
                raise ModelDirectoryError(
                    f"the tokenizer in {self.path} has no {token!r} token, which "
                    f"{layout.family} images are laid out with"
                )
            ids[token] = value
        return ids

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)


_views: dict[Path, ModelView] = {}
_views_lock = threading.Lock()


def model_view(path: Path, name: str = "") -> ModelView:
    """The (cached) view of the model directory at `path`, served under `name` or the directory's name."""
    key = path.resolve()
    with _views_lock:
        view = _views.get(key)
        if view is None or (name and view.name != name):
            view = ModelView(path=key, name=name or key.name)
            _views[key] = view
        return view
