"""`manage.py build_demo_model PATH`: writes the small random-weight Qwen2-VL demo checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from workers.demo_model import replace_demo_model


class Command(BaseCommand):
    help = "Build the demo Qwen2-VL checkpoint (random weights, locally trained tokenizer) into PATH."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", type=Path)
        parser.add_argument("--seed", type=int, default=0, help="seed of weights and tokenizer corpus")
        parser.add_argument("--force", action="store_true", help="replace a model already at PATH")
        parser.add_argument(
            "--heavy-vision",
            action="store_true",
            help="a deeper, wider vision tower, so encoding is a real share of a request's cost on a CPU",
        )

    def handle(
        self, *args: Any, path: Path, seed: int, force: bool, heavy_vision: bool = False, **options: Any
    ) -> None:
        path = path.resolve()
        if path.exists() and any(path.iterdir()) and not force:
            raise CommandError(f"{path} already holds files; pass --force to replace them")
        replace_demo_model(path, seed=seed, heavy_vision=heavy_vision)
        self.stdout.write(self.style.SUCCESS(f"demo model written to {path}"))
