"""The typed contract between frontend and worker: payloads round-trip, versions are checked."""

from __future__ import annotations

import json

import pytest

from routing.contract.tasks import (
    CONTRACT_VERSION,
    DONE,
    ERROR,
    TOKEN,
    ContractError,
    DoneEvent,
    EncodeTask,
    ErrorEvent,
    FlushCachesTask,
    GenerateTask,
    ImageRef,
    TokenEvent,
    UnsupportedContract,
    event_data,
    parse_event,
)


def a_task() -> GenerateTask:
    return GenerateTask(
        request_id="chatcmpl-1",
        prompt="<|im_start|>user\nHi<|im_end|>\n",
        max_tokens=8,
        temperature=0.5,
        top_p=0.9,
        images=(ImageRef(identity="a" * 32, url="http://x/1.png", width=64, height=48),),
        seed=7,
        stop=("\n",),
        scope_key="ab" * 16,
        block_hashes=(1, 2**63 + 5),
        processed={"input_ids": [1, 2]},
    )


def test_a_generate_task_survives_json_and_carries_the_contract_version():
    task = a_task()
    payload = json.loads(json.dumps(task.to_payload()))
    assert payload["contract_version"] == CONTRACT_VERSION
    assert GenerateTask.from_payload(payload) == task


def test_a_tasks_payload_is_asdicts_without_its_copies_of_what_cannot_change():
    """`to_payload` is `dataclasses.asdict` plus the version, for every kind of field (nested
    dataclasses, tuples of them and of numbers, dicts, lists); a list or dict in it is a copy of
    its own, as asdict's, and a tuple of numbers is the task's own (it cannot change)."""
    import dataclasses

    from routing.contract.tasks import VideoRef

    video = VideoRef(
        identity="v" * 32, fps=2.0, total_frames=40, indices=(0, 20), width=64, height=48,
        grid_thw=(1, 2, 2), frame_shape=(2, 48, 64, 3), media_ref="m1",
    )  # fmt: skip
    tasks = [
        a_task(),
        dataclasses.replace(
            a_task(),
            videos=(video,),
            logit_bias={"7": -1.5},
            processed={"pixel_values": {"ref": "r", "shape": [1, 3]}, "grid": [[1, 2, 2]]},
            continued_token_ids=(5, 6),
            image_ends=(30,),
            priority=2,
        ),
        EncodeTask(request_id="enc-1", images=(ImageRef(identity="b" * 32, media_ref="m2"),), indices=(0,)),
        FlushCachesTask(flush_id="f-1", kv=True),
    ]
    for task in tasks:
        payload = task.to_payload()
        assert payload == {**dataclasses.asdict(task), "contract_version": CONTRACT_VERSION}
        assert type(task).from_payload(json.loads(json.dumps(payload))) == task
    payload = tasks[1].to_payload()
    payload["processed"]["grid"][0].append(9)
    payload["logit_bias"]["8"] = 1.0
    assert tasks[1].processed["grid"] == [[1, 2, 2]] and tasks[1].logit_bias == {"7": -1.5}
    assert payload["block_hashes"] is tasks[1].block_hashes


def test_an_optional_field_a_worker_does_not_know_is_ignored_and_a_missing_one_takes_its_default():
    payload = a_task().to_payload()
    payload["media_refs"] = [{"future": "field"}]  # a newer frontend's optional field
    del payload["processed"], payload["scope_key"]  # an older frontend never sent these
    task = GenerateTask.from_payload(payload)
    assert task.processed is None and task.scope_key is None and task.prompt == a_task().prompt


@pytest.mark.parametrize("version", [None, 1, CONTRACT_VERSION + 1, "2"])
def test_a_payload_of_another_version_is_refused_naming_both_versions(version):
    payload = a_task().to_payload()
    payload["contract_version"] = version
    with pytest.raises(UnsupportedContract) as refused:
        GenerateTask.from_payload(payload, worker="gpu0")
    assert f"contract version {version!r}" in str(refused.value)
    assert f"speaks {CONTRACT_VERSION}" in str(refused.value) and "worker gpu0" in str(refused.value)
    assert refused.value.status == 503


def test_a_payload_missing_a_required_field_or_with_a_wrong_type_is_a_contract_error():
    payload = a_task().to_payload()
    del payload["prompt"]
    with pytest.raises(ContractError, match="prompt"):
        GenerateTask.from_payload(payload)
    payload = a_task().to_payload()
    payload["max_tokens"] = "many"
    with pytest.raises(ContractError, match="wrong type"):
        GenerateTask.from_payload(payload)


@pytest.mark.parametrize("task", [GenerateTask, EncodeTask, FlushCachesTask])
def test_a_payload_that_is_not_an_object_is_a_contract_error_for_every_task(task):
    with pytest.raises(ContractError, match="is an object, not list"):
        task.from_payload(["not", "a", "task"])


def test_a_flush_task_round_trips():
    task = FlushCachesTask(flush_id="flush-1", scope_key=None, kv=True, images=True)
    assert FlushCachesTask.from_payload(json.loads(json.dumps(task.to_payload()))) == task
    assert task.name == "workers.flush_caches" and GenerateTask.name == "workers.generate"


def test_stream_events_round_trip_through_their_json_data():
    for event in (TokenEvent("hé"), DoneEvent(text="x", completion_tokens=3), ErrorEvent(400, "bad", "no")):
        assert parse_event(event.type, json.loads(json.dumps(event_data(event)))) == event
    assert (TokenEvent.type, DoneEvent.type, ErrorEvent.type) == (TOKEN, DONE, ERROR)
    assert parse_event("future-kind", {}) is None


_ABSENT = object()


@pytest.mark.parametrize(
    ("said", "read"),
    [
        ("shortest_first", True),
        ("fcfs", False),
        (_ABSENT, None),
        ("", None),
        ("lottery", None),
        (["fcfs"], None),
    ],
)
def test_a_heartbeat_says_its_engines_schedule_and_the_router_reads_it_or_assumes_its_own(said, read):
    from inference_platform.serving.dispatch import worker_report
    from routing.fleet.registry import Heartbeat

    # given: a worker's heartbeat as JSON; an older worker's has no schedule at all, and a
    # malformed one may hold anything
    fields = json.loads(Heartbeat("gpu0", "demo", block_size=16).to_json())
    fields.pop("schedule_policy")
    if said is not _ABSENT:
        fields["schedule_policy"] = said

    # when: the frontend reads it for the router
    report = worker_report(Heartbeat.from_json(json.dumps(fields)))

    # then: a policy it knows is the load bound's word for that worker; anything else (None)
    # leaves the frontend's assumption (RoutingPolicy.shortest_first_queues)
    assert report.shortest_first is read


def test_a_heartbeat_reads_back_as_sent_and_an_older_or_newer_workers_beat_is_still_read():
    from routing.fleet.registry import Heartbeat

    # given: a beat of this version, several of its fields away from their defaults
    sent = Heartbeat(
        "gpu0",
        "demo",
        block_size=16,
        running=3,
        waiting=2,
        kv_blocks_used=7,
        stopping=True,
        prefill_tokens_per_s=1234.5,
        schedule_policy="fcfs",
        beat_at=17.25,
        fingerprint="f1",
    )

    # then: it is sent as every field of this version, nothing more; read, it is the beat sent,
    # a Heartbeat like any other (frozen, comparable)
    assert json.loads(sent.to_json()).keys() == Heartbeat.__dataclass_fields__.keys()
    read = Heartbeat.from_json(sent.to_json())
    assert read == sent and type(read) is Heartbeat and hash(read) == hash(sent)
    with pytest.raises(AttributeError):
        read.running = 0  # type: ignore[misc]

    # and: a beat with a field this frontend does not know (a newer worker's) or without the
    # contract version (a worker from before it) is read for the fields it knows
    fields = json.loads(sent.to_json())
    newer = Heartbeat.from_json(json.dumps({**fields, "a_later_field": 1}))
    assert newer == sent
    del fields["contract_version"], fields["beat_at"]
    older = Heartbeat.from_json(json.dumps(fields))
    assert (older.contract_version, older.beat_at, older.running) == (1, 0.0, 3)


def test_a_worker_tells_its_frontends_cancel_from_its_frontends_death(redis_client, key_namespace):
    from routing.contract.responses import ResponseWriter, cancel_key, live_key

    def writer_for(request_id: str) -> ResponseWriter:
        redis_client.set(live_key(key_namespace, request_id), b"1")  # its frontend follows it
        writer = ResponseWriter(redis_client, key_namespace, request_id)
        writer.follow(request_id)
        assert not writer.cancelled()
        return writer

    # given a request whose frontend ends it as ServedRequest does: the cancel, then the mark
    stopped = writer_for("stopped")
    redis_client.set(cancel_key(key_namespace, "stopped"), b"1")
    redis_client.delete(live_key(key_namespace, "stopped"))
    # and one whose frontend died: its mark lapsed, nothing asked
    orphan = writer_for("orphan")
    redis_client.delete(live_key(key_namespace, "orphan"))

    # then both stop, each for what it was
    assert stopped.cancelled() and stopped.cancel_seen and not stopped.abandoned
    assert orphan.cancelled() and orphan.abandoned and not orphan.cancel_seen
