"""Model cards in Redis: each worker publishes its model's routing files under the fingerprint it
announces, and a frontend that meets the fingerprint reads them back (routing.prompt.model_card).

Frontends and workers may run on different hosts, so a frontend builds its view of a model's
prompts from here rather than from a directory it may not see (Dynamo publishes a model card to
its discovery store for the same reason). A card is content-addressed, so publishing it again is
harmless and two workers of one model write the same bytes; it is kept without expiry, as small
as a tokenizer, and only as many as there are model versions.
"""

from __future__ import annotations

import redis

from routing.prompt.model_card import ModelCard, card_from_files

CARD_FAMILY = "model:card:"


def card_key(namespace: str, fingerprint: str) -> str:
    return f"{namespace}{CARD_FAMILY}{fingerprint}"


def publish_card(client: redis.Redis, namespace: str, card: ModelCard) -> None:
    """Store the card's files under its fingerprint (one hash: file name -> contents)."""
    client.hset(card_key(namespace, card.fingerprint), mapping=card.files)


def republish_if_lost(client: redis.Redis, namespace: str, card: ModelCard) -> bool:
    """Publish the card again if Redis lost it (restarted empty), so a frontend that meets the
    model afterwards can still load it; True if it did. One EXISTS per call: each heartbeat."""
    if client.exists(card_key(namespace, card.fingerprint)):
        return False
    publish_card(client, namespace, card)
    return True


def read_card(client: redis.Redis, namespace: str, fingerprint: str) -> ModelCard | None:
    """The card published under `fingerprint`; None when none was, or when what is stored there
    no longer hashes to it (a card is never trusted for a fingerprint it does not have)."""
    raw = client.hgetall(card_key(namespace, fingerprint))
    if not raw:
        return None
    card = card_from_files({name.decode(): content for name, content in raw.items()})
    return card if card.fingerprint == fingerprint else None
