"""`manage.py build_demo_model PATH [--family qwen2_vl|qwen3_vl|llava|llava_next]
[--size tiny|small|medium|qwen2-vl-2b|qwen2-vl-7b]`: writes a random-weight demo checkpoint (Qwen2-VL
by default; small unless a published size is asked for)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from workers.demo_model import DEMO_FAMILIES, DEMO_SIZES, MODEL_SIZES, replace_demo_model


class Command(BaseCommand):
    help = "Build a demo checkpoint (random weights, locally trained tokenizer) into PATH."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", type=Path)
        parser.add_argument("--seed", type=int, default=0, help="seed of weights and tokenizer corpus")
        parser.add_argument("--force", action="store_true", help="replace a model already at PATH")
        parser.add_argument(
            "--family", choices=DEMO_FAMILIES, default="qwen2_vl", help="the model family (default qwen2_vl)"
        )
        parser.add_argument(
            "--heavy-vision",
            action="store_true",
            help="a deeper, wider vision tower, so encoding is a real share of a request's cost on a CPU",
        )
        parser.add_argument(
            "--size",
            choices=DEMO_SIZES,
            default="tiny",
            help="the language model's size (default tiny, the tests' model); small and medium cost "
            "enough per token that a throughput bench times the engine, not the platform around it; "
            "qwen2-vl-2b and qwen2-vl-7b are the published models' dimensions in bf16 (for a GPU)",
        )

    def handle(
        self,
        *args: Any,
        path: Path,
        seed: int,
        force: bool,
        heavy_vision: bool = False,
        family: str = "qwen2_vl",
        size: str = "tiny",
        **options: Any,
    ) -> None:
        path = path.resolve()
        if path.exists() and any(path.iterdir()) and not force:
            raise CommandError(f"{path} already holds files; pass --force to replace them")
        if heavy_vision and family != "qwen2_vl":
            raise CommandError("--heavy-vision builds only the qwen2_vl demo")
        if heavy_vision and size in MODEL_SIZES:
            raise CommandError(f"--heavy-vision: size {size} has the published model's vision tower")
        if size != "tiny" and family != "qwen2_vl":
            raise CommandError("--size builds only the qwen2_vl demo")
        replace_demo_model(path, seed=seed, heavy_vision=heavy_vision, family=family, size=size)
        self.stdout.write(self.style.SUCCESS(f"{family} demo model written to {path}"))
