"""Which model a request names, and the frontend's view of it: the `model` field picks the pool.

A model is a row (routing.models.Model) that its first worker made, or an operator did. Rows are
kept in the process under the workers' generation (routing.fleet.worker_rows), so a model
disabled in the admin answers 404 from every frontend's next request, without a query per
request. A model's routing view (tokenizer, chat template, layouts) is built on first use from
the card its workers published in Redis under its fingerprint (routing.fleet.model_cards): a
frontend needs no access to the model's directory. At most MODEL_VIEWS_LOADED views stay loaded.

The deployment's own model (MODEL_PATH, MODEL_NAME) is served from its directory when the
frontend has it and no row says otherwise, as before models were rows.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import redis
from django.conf import settings

from inference_platform.serving.errors import ApiError
from routing.fleet.model_cards import read_card
from routing.fleet.worker_rows import MAX_AGE_S, current_generation
from routing.models import Model, ModelAlias
from routing.policy import DEPLOYMENT_POLICY, ModelPolicy
from routing.prompt.model_card import ModelCard, read_model_card
from routing.prompt.model_view import ModelView, model_view
from routing.state.expiring import ExpiringLru
from routing.state.redis_keys import sync_client

# The generation read only saves work (without it the rows are read from the database), so it
# waits briefly: a frozen Redis costs the request this, not a whole timeout, before the one
# of the call that needs Redis (tenants.keys does the same).
_GENERATION_TIMEOUT_S = 0.25


@dataclass(frozen=True)
class ModelRow:
    name: str
    enabled: bool
    fingerprint: str
    family: str
    always_listed: bool
    created_at: float  # Unix time
    policy: ModelPolicy = DEPLOYMENT_POLICY


@dataclass(frozen=True)
class Catalogue:
    """The model rows by name, and each alias's models with their weights."""

    models: dict[str, ModelRow]
    aliases: dict[str, tuple[tuple[str, int], ...]]


@dataclass(frozen=True)
class ServedModel:
    """A model a request may be served by: its view of prompts, its KV partition, its policy."""

    view: ModelView
    fingerprint: str  # what its workers must announce; "" for a directory that has no card
    policy: ModelPolicy = DEPLOYMENT_POLICY

    @property
    def name(self) -> str:
        return self.view.name


# The name MODEL_PATH's directory gives the deployment's model, kept a second: resolving the path
# is a system call per request, and an operator who re-points a symlink there is seen within it.
_NAME_KEPT_S = 1.0
_names: ExpiringLru[str] = ExpiringLru(max_entries=4)


def deployment_model_name() -> str:
    """The name of the deployment's own model: MODEL_NAME, else its directory's name."""
    if settings.MODEL_NAME:
        return settings.MODEL_NAME
    path = settings.MODEL_PATH
    name = _names.get(path)
    if name is None:
        name = Path(path).resolve().name
        _names.put(path, name, _NAME_KEPT_S)
    return name


def model_not_found(name: str, why: str = "does not exist") -> ApiError:
    return ApiError(404, f"The model '{name}' {why}.", code="model_not_found", param="model")


class WeightedRotation:
    """Smooth weighted round robin (nginx's): over every run of as many picks as the weights
    sum to, each target is picked exactly its weight's times, spread evenly (3 to 1: a, a, b, a).
    A canary then gets its share from the first requests on, not on average; each frontend
    process rotates on its own."""

    def __init__(self, targets: tuple[tuple[str, int], ...]) -> None:
        self.targets = targets
        self._total = sum(weight for _, weight in targets)
        self._credit = [0] * len(targets)
        self._lock = threading.Lock()

    def pick(self) -> str:
        with self._lock:
            for i, (_, weight) in enumerate(self.targets):
                self._credit[i] += weight
            best = max(range(len(self.targets)), key=self._credit.__getitem__)
            self._credit[best] -= self._total
            return self.targets[best][0]


class ModelPool:
    """This process's model rows and loaded views."""

    def __init__(self) -> None:
        self._rows: ExpiringLru[tuple[bytes, Catalogue]] = ExpiringLru(1)
        self._views: OrderedDict[tuple[str, str], ModelView] = OrderedDict()
        self._lock = threading.Lock()
        self._local_cards: dict[Path, ModelCard | None] = {}
        self._local: ExpiringLru[tuple[ServedModel | None]] = ExpiringLru(max_entries=4)
        self._rotations: dict[str, WeightedRotation] = {}  # by alias

    def rows(self) -> dict[str, ModelRow]:
        """Every model row by name."""
        return self.catalogue().models

    def catalogue(self) -> Catalogue:
        """The rows and aliases, read again when the workers' generation has moved."""
        try:
            client = sync_client(settings.REDIS_URL, timeout_s=_GENERATION_TIMEOUT_S)
            generation = current_generation(client, settings.REDIS_KEY_PREFIX)
        except redis.RedisError:
            generation = None  # the rows are read, not kept: the request fails where it needs Redis
        kept = self._rows.get(None)
        if kept is not None and kept[0] == generation:
            return kept[1]
        catalogue = _read_catalogue()
        if generation is not None:
            self._rows.put(None, (generation, catalogue), MAX_AGE_S)
        return catalogue

    def known(self, name: str) -> bool:
        """Whether `name` is a model or an alias of the catalogue last read, without reading it
        again (False before the first read, or once it aged out): a metric's label may carry it."""
        kept = self._rows.get(None)
        if kept is None:
            return False
        return name in kept[1].models or name in kept[1].aliases

    def resolve(self, name: str) -> ServedModel:
        """The model a request names (an alias: one of its models, by weight), or the OpenAI
        error a client gets for it: 404 for a name no row, alias or directory knows and for a
        disabled model, 503 while no card is published yet."""
        catalogue = self.catalogue()
        targets = [
            (model, weight) for model, weight in catalogue.aliases.get(name, ()) if model in catalogue.models
        ]
        targets = [(model, weight) for model, weight in targets if catalogue.models[model].enabled]
        if name not in catalogue.models and targets:
            name = self._rotation(name, tuple(targets)).pick()
        row = catalogue.models.get(name)
        local = self.local_model()
        if row is None:
            if local is not None and local.name == name:
                return local
            raise model_not_found(name)
        if not row.enabled:
            raise model_not_found(name, "is disabled")
        if local is not None and local.name == name and local.fingerprint == row.fingerprint:
            return dataclasses.replace(local, policy=row.policy)
        if not row.fingerprint:
            raise ApiError(
                503,
                f"No worker of the model '{name}' has announced its routing files yet.",
                code="model_unavailable",
            )
        return ServedModel(self._view(name, row.fingerprint), row.fingerprint, row.policy)

    def _rotation(self, alias: str, targets: tuple[tuple[str, int], ...]) -> WeightedRotation:
        """The alias's rotation over its targets (a new one when an operator changed them)."""
        with self._lock:
            rotation = self._rotations.get(alias)
            if rotation is None or rotation.targets != targets:
                rotation = self._rotations[alias] = WeightedRotation(targets)
            return rotation

    def local_model(self) -> ServedModel | None:
        """The deployment's own model from its directory, if this frontend has the directory:
        looked up again after _NAME_KEPT_S, as the model's name is (each look resolves the
        directory's path: system calls, ~25 us of CPU a request)."""
        key = (settings.MODEL_PATH, settings.MODEL_NAME)
        kept = self._local.get(key)
        if kept is not None:
            return kept[0]
        view = model_view(settings.MODEL_PATH, deployment_model_name())
        card = self._local_card(view.path)
        local = None if card is None else ServedModel(view, card.fingerprint)
        self._local.put(key, (local,), _NAME_KEPT_S)
        return local

    def _local_card(self, path: Path) -> ModelCard | None:
        with self._lock:
            if path not in self._local_cards:
                try:
                    self._local_cards[path] = read_model_card(path)
                except FileNotFoundError:
                    return None  # not kept: the directory may appear (a model built later)
            return self._local_cards[path]

    def _view(self, name: str, fingerprint: str) -> ModelView:
        key = (name, fingerprint)
        with self._lock:
            view = self._views.get(key)
            if view is not None:
                self._views.move_to_end(key)
                return view
        card = read_card(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX, fingerprint)
        if card is None:
            raise ApiError(
                503,
                f"The routing files of the model '{name}' (fingerprint {fingerprint}) are not "
                "published: start one of its workers.",
                code="model_unavailable",
            )
        view = ModelView(path=_materialised(card), name=name)
        with self._lock:
            self._views[key] = view
            while len(self._views) > settings.MODEL_VIEWS_LOADED:
                self._views.popitem(last=False)
        return view

    def loaded(self) -> list[tuple[str, str]]:
        """The (name, fingerprint) of each view loaded now, least recently used first."""
        with self._lock:
            return list(self._views)


def _read_catalogue() -> Catalogue:
    fields = (
        "name", "enabled", "fingerprint", "family", "always_listed", "created_at",
        "routing_mode", "overlap_credit", "prefill_load_scale", "temperature",
    )  # fmt: skip
    models = {}
    for name, enabled, fingerprint, family, listed, created, *policy in Model.objects.values_list(*fields):
        models[name] = ModelRow(
            name, enabled, fingerprint, family, listed, created.timestamp(), ModelPolicy(*policy)
        )
    aliases: dict[str, list[tuple[str, int]]] = {}
    for alias, model, weight in ModelAlias.objects.values_list("name", "model__name", "weight"):
        aliases.setdefault(alias, []).append((model, weight))
    return Catalogue(models, {alias: tuple(targets) for alias, targets in aliases.items()})


def _materialised(card: ModelCard) -> Path:
    """The card's files in a folder of their own, named by the fingerprint (content-addressed:
    written once, by whichever process gets there first, then only read)."""
    folder = Path(settings.MODEL_CARD_DIR) / card.fingerprint
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{card.fingerprint}-", dir=folder.parent))
    for name, content in card.files.items():
        (staging / name).write_bytes(content)
    try:
        staging.rename(folder)
    except OSError:  # another process wrote it first: its folder holds the same bytes
        shutil.rmtree(staging, ignore_errors=True)
    return folder
