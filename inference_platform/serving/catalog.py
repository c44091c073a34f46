"""The models a client sees in `/v1/models`: those with a live worker, and those an operator marked
always listed (routing.models.Model), enabled, with the aliases that stand for one of them; the
deployment's own model (MODEL_PATH) while this frontend has its directory and no row says
otherwise, as before models were rows."""

from __future__ import annotations

from dataclasses import dataclass

from asgiref.sync import async_to_sync

from inference_platform.serving.dispatch import worker_states
from inference_platform.serving.frontend import frontend
from inference_platform.serving.model_pool import ModelRow
from tenants.keys import ANONYMOUS, Caller


@dataclass(frozen=True)
class ListedModel:
    name: str
    created: int  # Unix time: when its row was made, or its directory last changed


def listed_models(caller: Caller = ANONYMOUS) -> list[ListedModel]:
    """The models to list to `caller` (a tenant limited to some models sees only those), by name,
    and each alias with a listed model among its own (synchronous: the rows may need a query)."""
    pool = frontend().models()
    catalogue = pool.catalogue()
    listed = {
        row.name: ListedModel(row.name, int(row.created_at))
        for row in catalogue.models.values()
        if row.enabled and (row.always_listed or _has_live_worker(row))
    }
    local = pool.local_model()
    if local is not None and local.name not in catalogue.models:
        listed[local.name] = ListedModel(local.name, int(local.view.path.stat().st_mtime))
    for alias, targets in catalogue.aliases.items():
        created = [listed[model].created for model, _ in targets if model in listed]
        if created and alias not in catalogue.models:
            listed[alias] = ListedModel(alias, min(created))
    return sorted((m for m in listed.values() if caller.may_use(m.name)), key=lambda model: model.name)


def _has_live_worker(row: ModelRow) -> bool:
    from django.conf import settings

    states = async_to_sync(worker_states)(row.name, settings.KV_BLOCK_SIZE, fingerprint=row.fingerprint)
    return any(state.heartbeat is not None and state.ineligible_because is None for state in states)
