"""Videos (and Qwen3-VL) in the engine: greedy output equals transformers' own `generate`, is the same
with and without the cached prefix, and a repeated video costs neither its frames nor the encoder.

Clips are made here with PyAV and decoded by the frontend's own code (routing.media.video), so the frames
the engine gets are exactly those a real request carries.
"""

from __future__ import annotations

import time

import pytest
import torch
from PIL import Image

from routing.media.images import url_identity
from routing.media.video import VideoLimits, decode_video
from tests.video_files import make_clip
from workers.embedding_cache import EmbeddingCache
from workers.engine import Engine, GenerationRequest, ImageInput, VideoInput
from workers.kv_cache import KvPool
from workers.video_inputs import VideoPreprocessor

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def chat(content: str) -> str:
    return f"{SYSTEM}<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen3_parts(qwen3_demo_dir):
    engine = Engine.load(qwen3_demo_dir)
    return engine.model, engine.processor, engine.video


@pytest.fixture(scope="module")
def qwen2_video(demo_model_dir):
    return VideoPreprocessor.for_model_dir(demo_model_dir)


@pytest.fixture(params=["qwen2_vl", "qwen3_vl"])
def family(request, shared_parts, qwen2_video, qwen3_parts):
    """A factory of engines (fresh caches each) of one family, with its video settings."""
    if request.param == "qwen2_vl":
        model, processor = shared_parts
        video = qwen2_video
    else:
        model, processor, video = qwen3_parts

    def build() -> Engine:
        return Engine(
            model=model,
            processor=processor,
            model_name=request.param,
            device="cpu",
            kv_pool=KvPool(capacity_blocks=512, block_size=16, worker="w"),
            embedding_cache=EmbeddingCache(64 << 20),
            load_image=lambda image, scope: Image.open(__import__("io").BytesIO(image.data)),
            video=video,
        )

    build.family = request.param
    return build


class Clip:
    """A clip as the frontend hands it over, counting how often its frames are read."""

    def __init__(self, preprocessor: VideoPreprocessor, *, seed: int = 0, frames: int = 48) -> None:
        indices, fps, total, width, height, identity, expansion, data = decode_video(
            make_clip(frames=frames, width=160, height=120, fps=12, seed=seed),
            preprocessor.layout,
            VideoLimits(),
        )
        self.frames, self.reads, self.expansion = data, 0, expansion
        self.input = VideoInput(
            identity=identity,
            fps=fps,
            total_frames=total,
            indices=indices,
            width=width,
            height=height,
            grid_thw=expansion.grid_thw,
            frame_shape=(len(indices), expansion.resized_height, expansion.resized_width, 3),
            load_frames=self._read,
        )

    def _read(self) -> bytes:
        self.reads += 1
        return self.frames


def ask(engine: Engine, clip: Clip, question: str, max_tokens: int = 12):
    request = GenerationRequest(
        request_id=question,
        prompt=chat(VIDEO + question),
        images=[],
        max_tokens=max_tokens,
        videos=[clip.input],
    )
    return engine.generate(request)


def reference_generate(engine: Engine, clip: Clip, question: str, max_tokens: int = 12) -> str:
    """transformers' own generate on the same ids and pixels: the oracle for the engine's output."""
    ids, placed = engine.layout.expand(chat(VIDEO + question), [], [], [clip.input])
    input_ids = torch.tensor([ids])
    mm_token_type_ids = (input_ids == engine.layout.video_token_id).to(torch.int) * 2
    pixels = engine.video.pixel_values(clip.frames, clip.input.frame_shape)
    with torch.inference_mode():
        output = engine.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values_videos=pixels,
            video_grid_thw=torch.tensor([placed[0].grid_thw]),
            mm_token_type_ids=mm_token_type_ids,
            max_new_tokens=max_tokens,
            do_sample=False,
        )
    return engine.tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True)


def test_a_video_prompt_answers_as_transformers_generate_does(family):
    engine = family()
    clip = Clip(engine.video)
    result = ask(engine, clip, "What happens in this clip?")
    assert result.text == reference_generate(engine, clip, "What happens in this clip?")
    assert result.encoder_calls == 1 and clip.reads == 1


def test_greedy_output_is_the_same_with_and_without_the_cached_video_prefix(family):
    # given an engine that has answered one question about a clip
    warm = family()
    clip = Clip(warm.video)
    ask(warm, clip, "What happens in this clip?")
    reads = clip.reads
    # when another question about the same clip comes
    cached = ask(warm, clip, "Which colours do you see?")
    uncached = ask(family(), clip, "Which colours do you see?")
    # then its answer is the one a cold engine gives, from a prefix that holds the whole video
    assert cached.text == uncached.text
    video_end = warm.layout.expand(chat(VIDEO), [], [], [clip.input])[1][0].end
    assert cached.cached_tokens >= video_end // 16 * 16
    assert uncached.cached_tokens == 0
    # and neither its frames nor the vision tower were needed
    assert cached.encoder_calls == 0 and clip.reads == reads + 1  # the cold engine's read only


def test_the_embedding_cache_holds_video_embeddings(family):
    # given a clip answered once, then the KV cache flushed
    engine = family()
    clip = Clip(engine.video)
    first = ask(engine, clip, "What happens in this clip?")
    engine.clear_kv_cache()
    # when it is asked about again
    again = ask(engine, clip, "What happens in this clip?")
    # then the encoder is skipped: the video's embedding came from the cache
    assert again.cached_tokens == 0
    assert (again.encoder_calls, again.embedding_cache_hits) == (0, 1)
    assert again.text == first.text


def test_two_clips_of_one_shape_are_not_confused(family):
    engine = family()
    one, other = Clip(engine.video, seed=1), Clip(engine.video, seed=2)
    ask(engine, one, "What happens in this clip?")
    result = ask(engine, other, "What happens in this clip?")
    # the shared text before the video is reused, the other video's blocks are not
    video_start = engine.layout.expand(chat(VIDEO), [], [], [other.input])[1][0].start
    assert result.cached_tokens <= video_start
    assert result.encoder_calls == 1
    assert result.text == ask(family(), other, "What happens in this clip?").text


def test_qwen3_vl_images_answer_as_generate_and_reuse_their_prefix(qwen3_parts):
    import io

    model, processor, video = qwen3_parts
    image = Image.frombytes("RGB", (200, 150), bytes(range(256)) * 352)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")

    def build() -> Engine:
        return Engine(
            model=model,
            processor=processor,
            model_name="qwen3",
            device="cpu",
            kv_pool=KvPool(capacity_blocks=512, block_size=16, worker="w"),
            embedding_cache=EmbeddingCache(64 << 20),
            load_image=lambda source, scope: Image.open(io.BytesIO(source.data)).convert("RGB"),
            video=video,
        )

    def request(question: str) -> GenerationRequest:
        source = ImageInput(identity="ab" * 16, data=buffer.getvalue(), width=200, height=150)
        return GenerationRequest(
            request_id=question, prompt=chat(IMAGE + question), images=[source], max_tokens=12
        )

    engine = build()
    first = engine.generate(request("Describe the picture."))
    # the oracle: transformers' processor and generate on the same prompt
    inputs = processor(text=[chat(IMAGE + "Describe the picture.")], images=[image], return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    expected = processor.tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert first.text == expected
    again = engine.generate(request("What else is in it?"))
    assert again.encoder_calls == 0 and again.cached_tokens > 0
    assert again.text == build().generate(request("What else is in it?")).text


def test_videos_batched_together_and_prefilled_in_small_chunks_answer_as_alone(family):
    # given an engine whose step budget cuts every video prompt into chunks of 24 tokens, so chunk
    # boundaries fall inside the videos (and, for Qwen3-VL, between their timestamps and frames)
    engine = family()
    engine.scheduler.max_batch_tokens = 24
    clips = [Clip(engine.video, seed=seed) for seed in (3, 4)]
    questions = ["What happens in this clip?", "Which colours do you see?"]
    alone = [
        reference_generate(engine, clip, question, 8) for clip, question in zip(clips, questions, strict=True)
    ]
    # when both are submitted at once and run in the same steps
    handles = [
        engine.submit(
            GenerationRequest(
                request_id=f"batched-{n}",
                prompt=chat(VIDEO + question),
                images=[],
                max_tokens=8,
                videos=[clip.input],
            )
        )
        for n, (clip, question) in enumerate(zip(clips, questions, strict=True))
    ]
    results = []
    for handle in handles:
        while (event := handle.events.get(timeout=120))[0] not in ("done", "error"):
            pass
        assert event[0] == "done", event
        results.append(event[1])
    # then each answer is what transformers' generate gives that request alone
    assert [result.text for result in results] == alone
    assert engine.running_peak == 2


def test_a_video_beside_a_picture_whose_features_an_encode_worker_sends_is_encoded_ahead(family):
    # given an E/PD request: a picture whose features were to come from an encode worker, and a
    # video, which this worker encodes itself while it waits (encode workers take pictures only)
    engine = family()
    clip = Clip(engine.video)
    picture = Image.new("RGB", (112, 84), (200, 40, 40))
    buffer = __import__("io").BytesIO()
    picture.save(buffer, "PNG")
    expected = ImageInput(
        identity=url_identity("https://img.test/red.png"),
        data=buffer.getvalue(),
        width=112,
        height=84,
        features_expected=True,
    )
    request = GenerationRequest(
        request_id="epd-video",
        prompt=chat(VIDEO + IMAGE + "What do they show?"),
        images=[expected],
        max_tokens=4,
        videos=[clip.input],
    )

    # when it waits for the features, which never come
    handle = engine.submit(request)
    time.sleep(0.3)
    handle.features_arrived()

    # then the engine went on (the video encoded ahead, the picture here after the wait)
    while True:
        kind, value = handle.events.get(timeout=60)
        if kind == "error":
            raise value
        if kind == "done":
            break
    assert value.completion_tokens == 4
    assert value.encoder_calls == 2 and clip.reads == 1
