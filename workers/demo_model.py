"""The demo checkpoints: a small, randomly initialised Qwen2-VL (and tiny LLaVA-1.5 / LLaVA-NeXT)
with locally trained tokenizers, built offline, plus the one function that loads their processors.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# Qwen2-VL's special tokens, in Qwen's order (their ids follow the trained vocabulary there; here
# they come first, which is all the config needs: it records whatever ids the tokenizer gives).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

VOCAB_SIZE = 4096
# Qwen2-VL's default is 1280 * 28 * 28 (1,280 image tokens). The demo caps an image at 448x448
# (256 image tokens) so a prefill with an image stays cheap on a CPU.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 448 * 448
# Video frames are kept smaller (a 30-second clip at 2 frames per second is 60 frames): at most
# 224x224 per frame, 64 placeholder tokens per pair of frames.
VIDEO_MIN_PIXELS = 56 * 56
VIDEO_MAX_PIXELS = 224 * 224
VIDEO_FPS = 2.0
VIDEO_MAX_FRAMES = 128

# The Jinja chat template of Qwen/Qwen2-VL-2B-Instruct.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2's pre-tokenizer split (contractions, letters, single digits, punctuation, spaces).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORD_ROOTS_TEXT = """
time year people way day man woman child world school state family student group country
problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job
word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education foot boy age policy
process music market sense nation plan college interest death experience effect use class
control care field development role effort rate heart drug show leader light voice wife
police mind price report decision son view relationship town road arm difference value
building action model season society tax director position player record paper space
ground form event official matter center couple site project activity star table need court
oil situation cost industry figure street image phone data picture practice piece land
product doctor wall patient worker news test movie north love support technology step baby
computer type attention film tree source organization hair window evidence population site
camera cat dog bird horse river mountain garden kitchen flower apple bread coffee bottle
window chair shirt shoe ticket train plane boat bridge tower castle forest island beach
desert ocean cloud storm snow rain summer winter spring autumn color shape circle square
triangle red green blue yellow orange purple black white brown gray pattern texture surface
corner edge shadow reflection label sign letter screen keyboard lamp clock mirror glass cup
plate bowl spoon fork knife box bag basket jacket hat glove scarf sock ring necklace watch
walk talk look see find give tell ask feel try leave call keep begin seem help turn start
hold bring write sit stand lose pay meet include continue set learn lead understand watch
follow stop create speak read allow add spend grow open offer remember consider appear buy
wait serve die send expect build stay fall cut reach kill remain suggest raise pass sell
require decide return explain hope develop carry break receive agree support hit produce
eat cover catch draw choose describe count paint print measure compare notice answer
small large good new first last long great little own other old big high different local
early young important public bad same able clear late hard major better economic strong
possible whole free military true federal international full special easy certain real
quiet bright dark warm cold soft heavy light sharp round flat smooth rough empty clean
quick slow happy sad careful simple recent natural similar central common general single
"""
_WORD_ROOTS = _WORD_ROOTS_TEXT.split()

_SUFFIXES = ("", "", "", "s", "ed", "ing", "er", "ers", "ly", "ness", "ful", "less", "able", "ment")

_SENTENCE_FRAMES = (
    "The {a} {n} near the {n2} looks {a2} in this picture.",
    "Describe the {n} and the {n2} shown in the image.",
    "What {n} is on the left side of the {n2}?",
    "A {a} {n} stands beside a {a2} {n2}.",
    "We {v} the {n} every {n2} because it is {a}.",
    "Please {v} how many {n}s are in the photo.",
    "In the {n}, a {a} {n2} was {v}ed by the {n3}.",
    "Is there a {a} {n} behind the {n2}? Answer yes or no.",
    "The {n} of the {n2} is {a}, and the {n3} is {a2}.",
    "They said the {n}'s {n2} would {v} before {n3} time.",
    "Count the {a} {n}s, then {v} the {n2}.",
    "I've seen {num} {n}s and {num2} {n2}s today.",
)


def demo_corpus(seed: int = 0, sentences: int = 30_000) -> list[str]:
    """A deterministic English-like corpus: frames filled with common words and their inflections."""
    rng = random.Random(seed)
    words = [root + suffix for root in _WORD_ROOTS for suffix in _SUFFIXES]
    lines: list[str] = []
    for _ in range(sentences):
        frame = rng.choice(_SENTENCE_FRAMES)
        lines.append(
            frame.format(
                a=rng.choice(words),
                a2=rng.choice(words),
                n=rng.choice(words),
                n2=rng.choice(words),
                n3=rng.choice(words),
                v=rng.choice(_WORD_ROOTS),
                num=rng.randint(0, 999),
                num2=rng.randint(0, 99),
            )
        )
    # Every word on its own too, so common inflections become single tokens.
    lines.extend(" ".join(words[i : i + 12]) for i in range(0, len(words), 12))
    return lines


def train_byte_level_bpe(vocab_size: int, special_tokens: Sequence[str], corpus: Iterable[str]) -> Any:
    """A byte-level BPE (``tokenizers.Tokenizer``) with Qwen2's pre-tokenizer, trained on `corpus`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def train_demo_tokenizer(seed: int = 0) -> Any:
    """Trains a Qwen2-style byte-level BPE of VOCAB_SIZE tokens with Qwen2-VL's special tokens."""
    return train_byte_level_bpe(VOCAB_SIZE, SPECIAL_TOKENS, demo_corpus(seed))


# The default vision tower is a small share of a request's cost. The heavy one (depth and width of
# a real tower's scale-down) makes encoding dominate an image request on a CPU, as a real model's
# tower does on a GPU, so encoder disaggregation can be measured here (bench/encoder_disagg.py).
DEFAULT_VISION = {"depth": 2, "embed_dim": 128, "num_heads": 4}
HEAVY_VISION = {"depth": 8, "embed_dim": 384, "num_heads": 6}

# The Qwen2-VL demo's language model by size. "tiny", the default, is what the tests load: with
# images and short answers it spends its time in vLLM's per-step overheads and the prompt, so a
# throughput figure measured on it says little about decoding. "small" (about 3x tiny's
# compute per token) and "medium" (about 8x) keep the head size (64, which the mrope_section
# below covers), the vocabulary, tokenizer and vision tower. Measured with bench/vllm_engine.py's
# direct run (two vLLM engines of one thread each, 8 requests in flight, 32 new tokens after
# ~540 prompt tokens with an image) on this 2-core machine: quiet, small 354-436 tok/s and medium
# 212-247 (505-529 and 266-283 with the model in vLLM's engine core process,
# VLLM_ENABLE_V1_MULTIPROCESSING=0); while three other engineers' tests ran, tiny 131, small
# 91-118, medium 57.
TEXT_SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small": {
        "hidden_size": 384,
        "intermediate_size": 1536,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
    },
    "medium": {
        "hidden_size": 512,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
}

# Published Qwen2-VL sizes (config.json of Qwen/Qwen2-VL-2B-Instruct and Qwen2-VL-7B-Instruct):
# the language model and the vision tower at their real dimensions, random weights, the demo's
# tokenizer and vocabulary (4,096 tokens against 151,936 / 152,064: only the embedding and the LM
# head are smaller, about 1 GB of the 7B's 16.6 GB in bf16). For timing the native engine on a
# GPU (bench/sim_calibration.py --size qwen2-vl-7b); saved in bf16, built on the GPU when there is
# one. Head size 128 in both, so 64 rotary frequencies in M-RoPE's sections.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "qwen2-vl-2b": {
        "text": {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
        },
        "vision": {"depth": 32, "embed_dim": 1280, "num_heads": 16},
        "tie_word_embeddings": True,
    },
    "qwen2-vl-7b": {
        "text": {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
        },
        "vision": {"depth": 32, "embed_dim": 1280, "num_heads": 16},
        "tie_word_embeddings": False,
    },
}
DEMO_SIZES = (*TEXT_SIZES, *MODEL_SIZES)


def _qwen_demo_tokenizer(seed: int) -> tuple[Any, dict[str, int]]:
    """The demo tokenizer as transformers loads it, and the ids of its special tokens."""
    from transformers import PreTrainedTokenizerFast

    backend = train_demo_tokenizer(seed)
    token_ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")],
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    return tokenizer, token_ids


def _qwen_generation_config(token_ids: dict[str, int]) -> Any:
    """Greedy decoding that stops at the end of a turn or of the text, as Qwen's checkpoints do."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=token_ids["<|endoftext|>"],
        eos_token_id=[token_ids["<|im_end|>"], token_ids["<|endoftext|>"]],
        pad_token_id=token_ids["<|endoftext|>"],
        do_sample=False,
    )


def _demo_config(token_ids: dict[str, int], vision: dict[str, int] | None = None, size: str = "tiny") -> Any:
    from transformers import Qwen2VLConfig

    published = MODEL_SIZES.get(size)
    extra: dict[str, Any] = {}
    if published is not None:
        text, vision = published["text"], published["vision"]
        # mrope_section covers head_dim / 2 = 64 rotary frequencies (temporal, height, width).
        mrope_section = [16, 24, 24]
        extra = {"rms_norm_eps": 1e-6}
    else:
        text, vision = TEXT_SIZES[size], vision or DEFAULT_VISION
        # mrope_section covers head_dim / 2 = 32 rotary frequencies (temporal, height, width).
        mrope_section = [8, 12, 12]
    hidden = text["hidden_size"]
    return Qwen2VLConfig(
        text_config={
            "vocab_size": VOCAB_SIZE,
            **text,
            **extra,
            "max_position_embeddings": 32768,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": mrope_section,
            },
            "bos_token_id": token_ids["<|endoftext|>"],
            "eos_token_id": token_ids["<|im_end|>"],
            "pad_token_id": token_ids["<|endoftext|>"],
        },
        vision_config={
            "depth": vision["depth"],
            "embed_dim": vision["embed_dim"],
            # The merger projects into the language model: this is the text hidden size.
            "hidden_size": hidden,
            "num_heads": vision["num_heads"],
            "mlp_ratio": 4,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        bos_token_id=token_ids["<|endoftext|>"],
        eos_token_id=token_ids["<|im_end|>"],
        pad_token_id=token_ids["<|endoftext|>"],
        tie_word_embeddings=published["tie_word_embeddings"] if published else False,
    )


def build_demo_model(path: Path, *, seed: int = 0, heavy_vision: bool = False, size: str = "tiny") -> None:
    """Writes the demo checkpoint (weights, config, tokenizer, chat template, image processor).

    `heavy_vision` builds the heavier vision tower (HEAVY_VISION); the language model is the same.
    `size` is the language model's (TEXT_SIZES): the tokenizer and the vision tower's shape are
    the same at every such size. A published size (MODEL_SIZES) brings its own vision tower, and
    is saved in bf16.
    """
    if size not in DEMO_SIZES:
        raise ValueError(f"no demo size {size!r}; choose from {', '.join(DEMO_SIZES)}")
    if size in MODEL_SIZES and heavy_vision:
        raise ValueError(f"size {size!r} has its published vision tower: no heavy_vision")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer, token_ids = _qwen_demo_tokenizer(seed)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    config = _demo_config(token_ids, HEAVY_VISION if heavy_vision else DEFAULT_VISION, size)
    torch.manual_seed(seed)
    if size in MODEL_SIZES:
        model = _published_size_model(Qwen2VLForConditionalGeneration, config, seed)
    else:
        model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config = _qwen_generation_config(token_ids)
    model.save_pretrained(path)

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    image_processor.save_pretrained(path)
    _write_qwen_preprocessor_fields(path / "preprocessor_config.json")
    _write_video_preprocessor_config(path, QWEN2_VIDEO_SETTINGS)
    (path / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE)

    # save_pretrained writes weights 0600; workers may run as another user (ENGINE-NOTES trap 9).
    for weights in path.glob("*.safetensors"):
        weights.chmod(0o644)


def _published_size_model(model_class: Any, config: Any, seed: int) -> Any:
    """A published-size model with random weights in bf16, initialised on the GPU when there is
    one (`seed` seeds every device): drawing a 7B's 8 billion random numbers is a moment there,
    and there is no float32 copy on the way to bf16."""
    import torch

    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with device:
        model = model_class._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def _write_qwen_preprocessor_fields(preprocessor_config: Path) -> None:
    # Qwen's published preprocessor_config.json carries min/max_pixels and the slow class name;
    # readers of the file (routing.prompt.layouts) look for those, and the PIL class accepts both.
    fields = json.loads(preprocessor_config.read_text())
    fields.update(
        {
            "min_pixels": MIN_PIXELS,
            "max_pixels": MAX_PIXELS,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor",
        }
    )
    preprocessor_config.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


# The video processor's settings as transformers saves them (video_preprocessor_config.json):
# routing.prompt.video_layouts reads sampling and sizing from here, the worker its normalisation too.
QWEN2_VIDEO_SETTINGS: dict[str, Any] = {
    "video_processor_type": "Qwen2VLVideoProcessor",
    "processor_class": "Qwen2VLProcessor",
    "size": {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "fps": VIDEO_FPS,
    "min_frames": 4,
    "max_frames": VIDEO_MAX_FRAMES,
    "do_sample_frames": True,
    "cap_pixels_per_frame": False,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OPENAI_CLIP_MEAN
    "image_std": [0.26862954, 0.26130258, 0.27577711],  # OPENAI_CLIP_STD
    "rescale_factor": 1 / 255,
}


def _write_video_preprocessor_config(path: Path, settings: dict[str, Any]) -> None:
    (path / "video_preprocessor_config.json").write_text(
        json.dumps(settings, indent=2, sort_keys=True) + "\n"
    )


def replace_demo_model(
    path: Path, *, seed: int = 0, heavy_vision: bool = False, family: str = "qwen2_vl", size: str = "tiny"
) -> None:
    """Builds into a sibling directory and swaps it in, so readers never see a half-written model."""
    path = Path(path)
    staging = path.with_name(path.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    if family == "qwen2_vl":
        build_demo_model(staging, seed=seed, heavy_vision=heavy_vision, size=size)
    else:
        build_demo_family(staging, family, seed=seed)
    if path.exists():
        shutil.rmtree(path)
    staging.rename(path)


# --- LLaVA families ----------------------------------------------------------------------------------
LLAVA_SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
LLAVA_VOCAB_SIZE = 1024
# One CLIP tile: 112 / 14 = 8x8 patches, so a LLaVA-1.5 image is 64 placeholder tokens.
LLAVA_TILE = 112
LLAVA_PATCH = 14
# Anyres grids of up to 2x2 tiles for the LLaVA-NeXT variant, as (height, width).
LLAVA_NEXT_PINPOINTS = [[112, 224], [224, 112], [224, 224]]

# LLaVA-1.5's conversation format (llava-hf's template, trimmed): "USER: <image>\n... ASSISTANT:".
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }} "
    "{% elif message['role'] == 'user' %}USER: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}<image>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% else %}ASSISTANT: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}{{ content['text'] }}{% endfor %}{% endif %}"
    "{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def train_llava_tokenizer(seed: int = 0) -> Any:
    """A small byte-level BPE with LLaVA's special tokens, `<image>` among them (no automatic BOS:
    the chat template writes it, so the processor and the router tokenize the same text alike)."""
    return train_byte_level_bpe(LLAVA_VOCAB_SIZE, LLAVA_SPECIAL_TOKENS, demo_corpus(seed, sentences=3_000))


def _llava_config(token_ids: dict[str, int], *, next: bool) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaNextConfig

    vision = CLIPVisionConfig(
        image_size=LLAVA_TILE,
        patch_size=LLAVA_PATCH,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=64,
    )
    text = LlamaConfig(
        vocab_size=LLAVA_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=token_ids["<s>"],
        eos_token_id=token_ids["</s>"],
        pad_token_id=token_ids["<pad>"],
        tie_word_embeddings=False,
    )
    common: dict[str, Any] = {
        "vision_config": vision,
        "text_config": text,
        "image_token_id": token_ids["<image>"],
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "tie_word_embeddings": False,
    }
    if next:
        return LlavaNextConfig(**common, image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    return LlavaConfig(**common)


def build_demo_llava(path: Path, *, next: bool = False, seed: int = 0) -> None:
    """Writes a tiny random LLaVA-1.5 (or, with `next`, LLaVA-NeXT) checkpoint: a CLIP tower of
    112-pixel tiles, a Llama text model, a locally trained tokenizer and the family's processor."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import (
        GenerationConfig,
        LlavaForConditionalGeneration,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    backend = train_llava_tokenizer(seed)
    token_ids = {token: backend.token_to_id(token) for token in LLAVA_SPECIAL_TOKENS}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens=["<image>"],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )

    tile = {"height": LLAVA_TILE, "width": LLAVA_TILE}
    if next:
        image_processor: Any = LlavaNextImageProcessorPil(
            size={"shortest_edge": LLAVA_TILE}, crop_size=tile, image_grid_pinpoints=LLAVA_NEXT_PINPOINTS
        )
        processor_class: Any = LlavaNextProcessor
        model_class: Any = LlavaNextForConditionalGeneration
    else:
        image_processor = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_TILE}, crop_size=tile)
        processor_class = LlavaProcessor
        model_class = LlavaForConditionalGeneration
    processor = processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=LLAVA_PATCH,
        vision_feature_select_strategy="default",
        # CLIP prepends a CLS feature, which the "default" strategy drops again.
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)

    torch.manual_seed(seed)
    model = model_class(_llava_config(token_ids, next=next)).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=token_ids["<s>"],
        eos_token_id=token_ids["</s>"],
        pad_token_id=token_ids["<pad>"],
        do_sample=False,
    )
    model.save_pretrained(path)
    for weights in path.glob("*.safetensors"):
        weights.chmod(0o644)


# --- Qwen3-VL ----------------------------------------------------------------------------------------
# Patch 16 and merge 2: images and frames resize to multiples of 32. Images as the Qwen2-VL demo's
# (at most 448x448); a video's pixel budget is for the whole clip (Qwen3-VL sizes all frames at
# once): a 30-second clip at 2 frames per second gets about 64 tokens per pair of frames.
QWEN3_MIN_PIXELS = 64 * 64
QWEN3_MAX_PIXELS = 448 * 448
QWEN3_VIDEO_SETTINGS: dict[str, Any] = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "processor_class": "Qwen3VLProcessor",
    "size": {"shortest_edge": 32 * 32 * 8, "longest_edge": 60 * 256 * 256},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "fps": VIDEO_FPS,
    "min_frames": 4,
    "max_frames": VIDEO_MAX_FRAMES,
    "do_sample_frames": True,
    "cap_pixels_per_frame": False,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "rescale_factor": 1 / 255,
}


def _qwen3_vl_config(token_ids: dict[str, int]) -> Any:
    from transformers import Qwen3VLConfig

    hidden = 256
    return Qwen3VLConfig(
        text_config={
            "vocab_size": VOCAB_SIZE,
            "hidden_size": hidden,
            "intermediate_size": 1024,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 32768,
            # Interleaved M-RoPE over head_dim / 2 = 32 frequencies, as the published models.
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [8, 12, 12],
                "mrope_interleaved": True,
            },
            "bos_token_id": token_ids["<|endoftext|>"],
            "eos_token_id": token_ids["<|im_end|>"],
            "pad_token_id": token_ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 4,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            # The merger projects into the language model: this is the text hidden size.
            "out_hidden_size": hidden,
            "num_position_embeddings": 576,
            # DeepStack: features of both vision layers are added to the first two decoder layers.
            "deepstack_visual_indexes": [0, 1],
        },
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def build_demo_qwen3_vl(path: Path, *, seed: int = 0) -> None:
    """Writes a tiny random Qwen3-VL checkpoint (Qwen3VLForConditionalGeneration, DeepStack vision
    tower, interleaved M-RoPE) with the demo tokenizer and Qwen3-VL's image and video settings."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, token_ids = _qwen_demo_tokenizer(seed)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE  # the same vision markers as Qwen3-VL's template
    tokenizer.save_pretrained(path)

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(_qwen3_vl_config(token_ids)).to(torch.float32).eval()
    model.generation_config = _qwen_generation_config(token_ids)
    model.save_pretrained(path)

    # transformers has no Qwen3-VL image processor class: the published checkpoints configure the
    # Qwen2-VL one with patch 16 and mean/std 0.5.
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_MAX_PIXELS},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    image_processor.save_pretrained(path)
    fields = json.loads((path / "preprocessor_config.json").read_text())
    fields.update(
        {
            "min_pixels": QWEN3_MIN_PIXELS,
            "max_pixels": QWEN3_MAX_PIXELS,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3VLProcessor",
        }
    )
    (path / "preprocessor_config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    _write_video_preprocessor_config(path, QWEN3_VIDEO_SETTINGS)
    (path / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE)
    for weights in path.glob("*.safetensors"):
        weights.chmod(0o644)


DEMO_FAMILIES = ("qwen2_vl", "qwen3_vl", "llava", "llava_next")


def build_demo_family(path: Path, family: str, *, seed: int = 0) -> None:
    """The demo checkpoint of one family (`DEMO_FAMILIES`) into `path`."""
    if family == "qwen2_vl":
        build_demo_model(path, seed=seed)
    elif family == "qwen3_vl":
        build_demo_qwen3_vl(path, seed=seed)
    elif family in ("llava", "llava_next"):
        build_demo_llava(path, next=family == "llava_next", seed=seed)
    else:
        raise ValueError(f"no demo model for family {family!r}; choose from {', '.join(DEMO_FAMILIES)}")
