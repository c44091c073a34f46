"""Models as rows: the routing card and its fingerprint, the model a request names, and the pool
of workers it picks (issue 37). Real Redis and database; workers are heartbeats (the fleet as the
frontend sees it), the end-to-end proof with worker processes is tests/test_models_end_to_end.py."""

from __future__ import annotations

import shutil
import time
from collections import Counter

import pytest
import redis
from django.conf import settings as django_settings

from inference_platform.api.chat_request import parse_chat_request
from inference_platform.metrics import model_families, render_metrics
from inference_platform.serving import dispatch
from inference_platform.serving.errors import ApiError
from inference_platform.serving.prepare import prepare
from routing.fleet.model_cards import card_key, publish_card, read_card, republish_if_lost
from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.models import Model, Worker, model_fleets
from routing.prompt.hashing import block_hashes, cache_salt, partition_salt
from routing.prompt.model_card import read_model_card

pytestmark = pytest.mark.django_db(transaction=True)


def _chat(model: str, text: str = "Describe the sea at night, slowly and in detail, please."):
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    return parse_chat_request(body, max_tokens_limit=64)


def _beat(name: str, model: str, fingerprint: str) -> Heartbeat:
    return Heartbeat(
        name=name, model=model, block_size=django_settings.KV_BLOCK_SIZE, fingerprint=fingerprint
    )


def test_the_fingerprint_follows_the_routing_files_not_the_weights(demo_model_dir, tmp_path):
    # given a copy of the demo checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(demo_model_dir, copy)
    original = read_model_card(demo_model_dir)
    # when its weights change, then its chat template
    (copy / "model.safetensors").write_bytes(b"other weights")
    after_weights = read_model_card(copy)
    (copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    after_template = read_model_card(copy)
    # then only the template, which routing reads, changes the fingerprint
    assert original.family == "qwen2_vl" and len(original.fingerprint) == 32
    assert after_weights.fingerprint == original.fingerprint
    assert after_template.fingerprint != original.fingerprint


def test_a_published_card_reads_back_and_one_altered_in_redis_is_refused(
    redis_client, key_namespace, demo_model_dir
):
    # given a worker's published card
    card = read_model_card(demo_model_dir)
    publish_card(redis_client, key_namespace, card)
    # then it reads back whole under its fingerprint
    assert read_card(redis_client, key_namespace, card.fingerprint) == card
    # and once its files no longer hash to the fingerprint, it is not trusted for it
    redis_client.hset(card_key(key_namespace, card.fingerprint), "tokenizer_config.json", b"{}")
    assert read_card(redis_client, key_namespace, card.fingerprint) is None
    assert read_card(redis_client, key_namespace, "0" * 32) is None


def test_a_card_redis_lost_is_published_again_at_the_next_beat(redis_client, key_namespace, demo_model_dir):
    # given a worker's published card, and a Redis that lost it (restarted empty)
    card = read_model_card(demo_model_dir)
    publish_card(redis_client, key_namespace, card)
    assert not republish_if_lost(redis_client, key_namespace, card)  # present: nothing to do
    redis_client.delete(card_key(key_namespace, card.fingerprint))
    # when the worker beats
    assert republish_if_lost(redis_client, key_namespace, card)
    # then frontends can read it again
    assert read_card(redis_client, key_namespace, card.fingerprint) == card


def test_the_first_announcement_records_the_fingerprint_and_a_later_one_cannot_change_it():
    # given a model first announced by a worker
    first = Model.announce("vlm", "qwen2_vl", "a" * 32)
    # when another worker announces the name with another fingerprint
    second = Model.announce("vlm", "qwen2_vl", "b" * 32)
    # then the row keeps the first: the mismatch is the operator's to resolve
    assert first.fingerprint == second.fingerprint == "a" * 32
    # and a row an operator made without a fingerprint takes the first worker's
    Model.objects.create(name="made-by-hand")
    assert Model.announce("made-by-hand", "llava", "c" * 32).fingerprint == "c" * 32


@pytest.mark.usefixtures("served_demo_model")
def test_an_unknown_model_and_a_disabled_one_are_404_model_not_found(demo_model_dir):
    # given a second model an operator disabled
    Model.objects.create(
        name="retired", fingerprint=read_model_card(demo_model_dir).fingerprint, enabled=False
    )
    for name, why in (("no-such-model", "does not exist"), ("retired", "is disabled")):
        # when a request names it
        with pytest.raises(ApiError) as refused:
            prepare(_chat(name))
        # then it is refused before any work, as OpenAI refuses a model it does not have
        assert (refused.value.status, refused.value.code, refused.value.param) == (
            404,
            "model_not_found",
            "model",
        )
        assert why in refused.value.message


def test_a_frontend_without_the_model_directory_prepares_from_the_published_card(
    settings, tmp_path, demo_model_dir
):
    # given a frontend that cannot see the model's directory, and the card a worker published
    settings.MODEL_PATH = tmp_path / "absent"
    settings.MODEL_CARD_DIR = tmp_path / "cards"
    card = read_model_card(demo_model_dir)
    publish_card(redis.Redis.from_url(settings.REDIS_URL), settings.REDIS_KEY_PREFIX, card)
    Model.announce("remote-vlm", card.family, card.fingerprint)
    # when a request names the model
    prepared = prepare(_chat("remote-vlm"))
    # then its prompt and tokens are those of the directory itself, in the model's partition
    settings.MODEL_PATH, settings.MODEL_NAME = demo_model_dir, "remote-vlm"
    from inference_platform.serving.frontend import frontend

    frontend().reset()
    local = prepare(_chat("remote-vlm"))
    assert prepared.prompt == local.prompt and prepared.view.tokens == local.view.tokens
    assert prepared.fingerprint == local.fingerprint == card.fingerprint
    assert prepared.view.block_hashes == local.view.block_hashes
    assert prepared.view.block_hashes == block_hashes(
        prepared.view.tokens, 16, salt=partition_salt(card.fingerprint, None)
    )


def test_one_prompt_sent_to_two_models_shares_no_block_and_tenant_salts_compose():
    tokens = list(range(64))
    tenant = cache_salt("tenant", "t1")
    hashes = {
        (model, salt): tuple(block_hashes(tokens, 16, salt=partition_salt(model, salt)))
        for model in ("a" * 32, "b" * 32)
        for salt in (None, tenant)
    }
    # every (model, tenant) partition is apart from every other, from the first block on
    firsts = [h[0] for h in hashes.values()]
    assert len(set(firsts)) == 4
    # and without a model fingerprint (a bare engine) the caller's salt alone folds, as before
    assert partition_salt("", tenant) == tenant and partition_salt("", None) is None


async def test_a_worker_announcing_another_fingerprint_gets_none_of_the_models_requests_and_is_flagged():
    # given a model, a worker announcing its fingerprint and one announcing another under its name
    model = await Model.objects.acreate(name="vlm", fingerprint="a" * 32)
    good, bad = _beat("good", "vlm", "a" * 32), _beat("bad", "vlm", "f" * 32)
    for beat in (good, bad):
        await Worker.objects.acreate(name=beat.name, model_name=beat.model)
        WorkerRegistry(
            redis.Redis.from_url(django_settings.REDIS_URL), django_settings.REDIS_KEY_PREFIX
        ).beat(beat, 30)
    # when the frontend looks for the model's workers
    eligible = await dispatch.eligible_workers("vlm", django_settings.KV_BLOCK_SIZE, model.fingerprint)
    states = await dispatch.worker_states("vlm", django_settings.KV_BLOCK_SIZE, fingerprint=model.fingerprint)
    # then only the one announcing the model's fingerprint may take a request, and why not the other
    assert set(eligible) == {"good"}
    assert "fingerprint " + "f" * 32 in {s.name: s.ineligible_because for s in states}["bad"]
    # and the admin's and /metrics' view flags it
    fleets = model_fleets([model], [good, bad])
    assert [b.name for b in fleets["vlm"].serving] == ["good"]
    assert [b.name for b in fleets["vlm"].mismatched] == ["bad"]
    exposition = render_metrics(list(model_families(fleets)))
    assert 'mmr_model_fingerprint_mismatch{model="vlm",worker="bad"} 1.0' in exposition
    assert 'mmr_model_live_workers{model="vlm"} 1.0' in exposition


async def test_the_request_path_reads_only_the_chosen_models_worker_keys(monkeypatch):
    # given two models of 32 workers each
    for model in ("small", "large"):
        for n in range(32):
            beat = _beat(f"{model}{n}", model, model[0] * 32)
            await Worker.objects.acreate(name=beat.name, model_name=model)
            WorkerRegistry(
                redis.Redis.from_url(django_settings.REDIS_URL), django_settings.REDIS_KEY_PREFIX
            ).beat(beat, 30)
    read: Counter[str] = Counter()
    real_mget = redis.Redis.mget

    def counting_mget(self, keys, *args):
        read.update(k.decode() if isinstance(k, bytes) else k for k in keys)
        return real_mget(self, keys, *args)

    monkeypatch.setattr(redis.Redis, "mget", counting_mget)
    # when requests for one model look for their workers, the first reading the rows, the next kept
    for _ in range(2):
        eligible = await dispatch.eligible_workers("small", django_settings.KV_BLOCK_SIZE, "s" * 32)
        assert len(eligible) == 32
    # then only that model's heartbeats were read, each at most once per request (the frontend's
    # read of the model's pool may serve the second: serving.dispatch.FleetRead)
    heartbeats = {k for k in read if ":hb:" in k}
    assert heartbeats == {f"{django_settings.REDIS_KEY_PREFIX}hb:small{n}" for n in range(32)}
    assert all(1 <= read[k] <= 2 for k in heartbeats)


@pytest.mark.usefixtures("served_demo_model")
def test_a_tenant_limited_to_one_model_sees_only_it_and_gets_404_for_another(make_api_key, demo_model_dir):
    from django.test import Client

    # given two models (the deployment's own, and one an operator lists though no worker is live)
    Model.objects.create(
        name="other-vlm", fingerprint=read_model_card(demo_model_dir).fingerprint, always_listed=True
    )
    limited = Client(headers={"Authorization": f"Bearer {make_api_key('limited', allowed_models='demo')}"})
    everyone = Client(headers={"Authorization": f"Bearer {make_api_key('unlimited')}"})
    # when each tenant lists the models
    listed = {
        name: [m["id"] for m in client.get("/v1/models").json()["data"]]
        for name, client in (("limited", limited), ("unlimited", everyone))
    }
    # then the limited tenant sees only its model, the other tenant both
    assert listed == {"limited": ["demo"], "unlimited": ["demo", "other-vlm"]}
    assert limited.get("/v1/models/other-vlm").status_code == 404
    # and a request for the other model is a 404 model_not_found, before any work
    body = {"model": "other-vlm", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    refused = limited.post("/v1/chat/completions", body, content_type="application/json")
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"


@pytest.mark.usefixtures("served_demo_model")
def test_a_weighted_alias_splits_requests_between_its_models_in_its_ratio(demo_model_dir):
    from inference_platform.serving.frontend import frontend

    # given two versions of a model behind one alias, weighted 3 to 1
    fingerprint = read_model_card(demo_model_dir).fingerprint
    current = Model.objects.create(name="vlm-v1", fingerprint=fingerprint)
    canary = Model.objects.create(name="vlm-v2", fingerprint=fingerprint)
    current.aliases.create(name="vlm", weight=3)
    canary.aliases.create(name="vlm", weight=1)
    publish_card(
        redis.Redis.from_url(django_settings.REDIS_URL),
        django_settings.REDIS_KEY_PREFIX,
        read_model_card(demo_model_dir),
    )
    # when 800 requests name the alias
    chosen = [frontend().models().resolve("vlm").name for _ in range(800)]
    # then each version gets exactly its share, in every run of four requests from the first on
    runs = [Counter(chosen[i : i + 4]) for i in range(0, 800, 4)]
    assert all(run == {"vlm-v1": 3, "vlm-v2": 1} for run in runs)
    # and once the canary is disabled, the alias stands for the current version alone
    Model.objects.filter(name="vlm-v2").update(enabled=False)
    assert {frontend().models().resolve("vlm").name for _ in range(50)} == {"vlm-v1"}


@pytest.mark.usefixtures("served_demo_model")
def test_a_models_own_routing_policy_overrides_the_deployments_field_by_field(demo_model_dir):
    from inference_platform.serving.frontend import frontend

    # given a model routed round robin with its own temperature, the rest left to the deployment
    Model.objects.create(
        name="demo",
        fingerprint=read_model_card(demo_model_dir).fingerprint,
        routing_mode="round_robin",
        temperature=0.5,
    )
    deployment = frontend().policy()
    # when a request for it is prepared
    prepared = prepare(_chat("demo"))
    policy = prepared.policy.over(deployment)
    # then its own fields apply and the others are the deployment's
    assert (policy.mode, policy.routing.temperature) == ("round_robin", 0.5)
    assert policy.routing.overlap_credit == deployment.routing.overlap_credit
    assert policy.session_affinity == deployment.session_affinity


def test_the_admin_lists_each_model_with_its_live_workers_and_flags_a_mismatch(admin_client):
    # given a model with one worker announcing its fingerprint and one announcing another
    model = Model.objects.create(name="vlm", family="qwen2_vl", fingerprint="a" * 32)
    model.aliases.create(name="vlm-latest")
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    for beat in (_beat("good", "vlm", "a" * 32), _beat("bad", "vlm", "f" * 32)):
        Worker.objects.create(name=beat.name, model_name=beat.model, role="both")
        WorkerRegistry(client, django_settings.REDIS_KEY_PREFIX).beat(beat, 30)
    # when an operator opens the models' list and the model's page
    listing = admin_client.get("/admin/routing/model/").content.decode()
    page = admin_client.get(f"/admin/routing/model/{model.pk}/change/").content.decode()
    # then the list shows the serving worker with its role and cache, and flags the other
    assert "good (both, 0/0)" in listing
    assert "bad (ffffffffffff)" in listing
    assert "vlm-latest" in page and "Routing policy" in page


def test_a_frontend_without_the_deployments_model_is_ready_while_another_model_has_a_worker(
    settings, tmp_path
):
    from django.test import Client

    # given a frontend with no model directory, and a live worker of a model row
    settings.MODEL_PATH = tmp_path / "absent"
    Model.objects.create(name="remote-vlm", fingerprint="a" * 32)
    Worker.objects.create(name="remote0", model_name="remote-vlm")
    registry = WorkerRegistry(redis.Redis.from_url(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)
    registry.beat(_beat("remote0", "remote-vlm", "a" * 32), 30)
    # then it is ready: some model can be served
    ready = Client().get("/ready")
    assert ready.status_code == 200 and ready.json()["accepting_workers"] == 1
    # and once that worker is gone (and the frontend's read of the fleet is older than
    # FLEET_VIEW_MAX_AGE_SECS), it is not
    registry.remove("remote0")
    dispatch.forget_fleet_read()
    assert Client().get("/ready").status_code == 503


def test_a_model_directory_built_after_the_frontend_started_is_served_within_a_second(
    demo_model_dir, tmp_path, settings, monkeypatch
):
    from inference_platform.serving.model_pool import ModelPool

    # given MODEL_PATH a directory not built yet, and the frontend's look at it
    directory = tmp_path / "demo"
    settings.MODEL_PATH, settings.MODEL_NAME = directory, ""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])  # the kept look's clock
    pool = ModelPool()
    assert pool.local_model() is None

    # when the model is built there
    shutil.copytree(demo_model_dir, directory)

    # then the look kept for a second stands, and after it the model is the deployment's own
    now[0] += 0.5
    assert pool.local_model() is None
    now[0] += 0.6
    local = pool.local_model()
    assert local is not None and local.name == "demo"
    assert local.fingerprint == read_model_card(demo_model_dir).fingerprint


def test_the_deployments_model_name_follows_a_re_pointed_directory_link_within_a_second(
    tmp_path, settings, monkeypatch
):
    from inference_platform.serving import model_pool

    # given MODEL_PATH a link to one model's directory, and no MODEL_NAME
    (tmp_path / "qwen-a").mkdir()
    (tmp_path / "qwen-b").mkdir()
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "qwen-a")
    settings.MODEL_PATH, settings.MODEL_NAME = str(link), ""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])  # the kept name's clock
    assert model_pool.deployment_model_name() == "qwen-a"

    # when an operator re-points the link
    link.unlink()
    link.symlink_to(tmp_path / "qwen-b")

    # then the name kept for a second stands, and after it the new directory names the model
    now[0] += 0.5
    assert model_pool.deployment_model_name() == "qwen-a"
    now[0] += 0.6
    assert model_pool.deployment_model_name() == "qwen-b"
    # and a MODEL_NAME names it whatever the directory
    settings.MODEL_NAME = "served-as"
    assert model_pool.deployment_model_name() == "served-as"
