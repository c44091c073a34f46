"""Runs one engine step on the model: every scheduled token of every request packed into one
sequence, attention over the paged pool (`workers.paged_attention`), explicit positions (M-RoPE
for Qwen2-VL/2.5-VL/Qwen3-VL, 1-D for LLaVA), image and video embeddings placed in each request's
rows (and Qwen3-VL's DeepStack features added at them). Also encodes images and videos with the
model's vision tower.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from workers import paged_attention
from workers.paged_attention import DecodeGroup, KvPoolTensors, PagedStep, PrefillChunk
from workers.prompt_layout import PromptImage, PromptLayout


@dataclass
class ChunkInput:
    """One request's tokens for this step, and what the runner needs to place them."""

    tokens: list[int]  # the tokens fed this step
    start: int  # position of the first of them in the request's sequence
    block_ids: list[int]  # the request's block table (covers start + len(tokens))
    prompt_len: int
    # M-RoPE positions of the whole prompt (3, prompt_len) and the delta of later tokens; None: 1-D.
    mrope: torch.Tensor | None = None
    rope_delta: int = 0
    # (row in this chunk, embedding rows) of images whose placeholders fall in the chunk. Qwen3-VL
    # rows carry the DeepStack features after the embedding, in the same row (see `encode_image`).
    image_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    sample: bool = True  # whether the chunk's last token's logits are wanted


class ModelRunner:
    def __init__(
        self, model: Any, layout: PromptLayout, *, device: str, blocks: int, block_size: int
    ) -> None:
        self.model = model
        self.layout = layout
        self.device = torch.device(device)
        self.block_size = block_size
        text_config = model.config.get_text_config()
        paged_attention.install(model)
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        zero_whole_pool = self.device.type != "cpu"
        self.pool = KvPoolTensors(
            layers=text_config.num_hidden_layers,
            blocks=blocks,
            block_size=block_size,
            kv_heads=text_config.num_key_value_heads,
            head_dim=head_dim,
            dtype=model.dtype,
            device=self.device,
            zeroed=zero_whole_pool,
        )
        # Blocks are zeroed on first use (or all at once, off the CPU): a padded or partly filled
        # block must hold finite numbers (masked keys still enter the product, and NaN * 0 is NaN).
        self._zeroed = bytearray(b"\x01" * blocks) if zero_whole_pool else bytearray(blocks)
        self.language_model = model.model.language_model
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.lm_head
        self.uses_mrope = layout.uses_mrope
        self._offsets = torch.arange(block_size, device=self.device)
        self.hidden_size = text_config.hidden_size
        # Qwen3-VL adds vision features of several tower layers to the first decoder layers (DeepStack).
        vision_config = getattr(model.config, "vision_config", None)
        self.deepstack = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())
        self.second_per_grid = model.config.model_type == "qwen2_5_vl"  # its video positions use time

    # --- positions and images ------------------------------------------------------------------------
    def rope_positions(self, input_ids: list[int], placed: list[PromptImage]) -> tuple[torch.Tensor, int]:
        """Qwen's M-RoPE positions of the whole prompt (3, n), and the delta of the tokens after it
        (ENGINE-NOTES trap 3: never the 1-D fallback, never the model's remembered delta).

        Computed on the CPU whatever the device: it is index arithmetic with a Python loop over
        the images, run in the submitting thread, which on a GPU would wait for the engine
        thread's step at each of its reads. A step moves the columns it uses to the device."""
        cpu = torch.device("cpu")
        ids = torch.tensor([input_ids], dtype=torch.long, device=cpu)
        mm_token_type_ids = (ids == self.layout.image_token_id).to(torch.int)
        if self.layout.video_token_id is not None:
            mm_token_type_ids[ids == self.layout.video_token_id] = 2  # video (0 text, 1 image)
        images = [media.grid_thw for media in placed if media.kind == "image"]
        videos = [media for media in placed if media.kind == "video"]
        extra: dict[str, torch.Tensor] = {}
        if videos:
            extra["video_grid_thw"] = torch.tensor(
                [video.grid_thw for video in videos], dtype=torch.long, device=cpu
            )
            if self.second_per_grid:
                # Qwen2.5-VL places video frames in time: seconds per temporal patch.
                extra["second_per_grid_ts"] = torch.tensor(
                    [self.layout.video.layout.temporal_patch_size / self.layout.video.layout.fps]
                    * len(videos)
                )
        with torch.inference_mode():
            positions, deltas = self.model.model.get_rope_index(
                ids,
                mm_token_type_ids=mm_token_type_ids,
                image_grid_thw=torch.tensor(images, dtype=torch.long, device=cpu) if images else None,
                **extra,
            )
        return positions[:, 0], int(deltas.reshape(-1)[0])

    def encode_image(self, image: PromptImage) -> torch.Tensor:
        """The image's (or video's) features as the language model takes them: one row per
        placeholder token. Qwen3-VL: each row is the embedding followed by its DeepStack features
        (hidden size each), so the rows slice and cache as one tensor."""
        with torch.inference_mode():
            if image.kind == "video":
                output = self.model.model.get_video_features(
                    self.layout.video.pixel_values(image.frames, tuple(image.source.frame_shape)).to(
                        self.device, self.model.dtype
                    ),
                    torch.tensor([image.grid_thw], dtype=torch.long, device=self.device),
                    return_dict=True,
                )
            elif self.uses_mrope:
                pixel_values, grid_thw = self._image_pixels(image)
                output = self.model.model.get_image_features(
                    self._on_device(pixel_values), grid_thw.to(self.device), return_dict=True
                )
            else:
                # The family's get_image_features selects the configured layer and strategy,
                # projects, and (LLaVA-NeXT) unpads the anyres grid and adds its newline features.
                pixels = self._llava_pixels(image)
                output = self.model.model.get_image_features(
                    **{name: self._on_device(tensor) for name, tensor in pixels.items()}, return_dict=True
                )
        embedding = output.pooler_output[0]
        placeholders = image.length if image.pad_positions is None else len(image.pad_positions)
        if embedding.shape[0] != placeholders:
            raise RuntimeError(
                f"the vision tower made {embedding.shape[0]} features for {placeholders} placeholder tokens"
            )
        if self.deepstack:
            embedding = torch.cat([embedding, *(layer[0] for layer in output.deepstack_features)], dim=-1)
        return embedding

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """An input on the model's device; pixel values (floating point) in its dtype too."""
        if tensor.is_floating_point():
            return tensor.to(self.device, self.model.dtype)
        return tensor.to(self.device)

    def _llava_pixels(self, image: PromptImage) -> dict[str, torch.Tensor]:
        """pixel_values (and LLaVA-NeXT's image_sizes) of one image: the frontend's, else made here."""
        if image.pixel_values is not None:
            first, last = image.pixel_rows
            pixels = {"pixel_values": image.pixel_values[first:last]}
            if image.image_sizes is not None:
                pixels["image_sizes"] = image.image_sizes[first:last]
            return pixels
        features = self.layout.image_processor(images=[image.image], return_tensors="pt")
        return {name: features[name] for name in ("pixel_values", "image_sizes") if name in features}

    def _image_pixels(self, image: PromptImage) -> tuple[torch.Tensor, torch.Tensor]:
        """The image's patches and grid: the frontend's rows when it sent them, else preprocessed here."""
        if image.pixel_values is not None:
            first, last = image.pixel_rows
            return image.pixel_values[first:last], torch.tensor([image.grid_thw], dtype=torch.long)
        features = self.layout.image_processor(images=[image.image], return_tensors="pt")
        grid = tuple(int(n) for n in features["image_grid_thw"][0])
        if grid != image.grid_thw:
            raise RuntimeError(
                f"image processor made grid {grid}, the prompt was laid out for {image.grid_thw}"
            )
        return features["pixel_values"], features["image_grid_thw"]

    # --- one step --------------------------------------------------------------------------------------
    def run(self, chunks: list[ChunkInput]) -> torch.Tensor:
        """One forward pass over the chunks; returns the logits of those that sample, in order.

        Decodes (one token each) go first in the packed sequence and are attended together;
        longer chunks follow, each attended on its own with a causal mask shifted by its start.
        """
        bs = self.block_size
        decodes = [chunk for chunk in chunks if len(chunk.tokens) == 1]
        longer = [chunk for chunk in chunks if len(chunk.tokens) > 1]
        ordered = decodes + longer
        for chunk in ordered:
            self._zero_new_blocks(chunk.block_ids)

        ids: list[int] = []
        write_slots: list[int] = []
        for chunk in decodes:
            ids.append(chunk.tokens[0])
            write_slots.append(chunk.block_ids[chunk.start // bs] * bs + chunk.start % bs)
        slot_tensors = [torch.tensor(write_slots, dtype=torch.long, device=self.device)]
        prefill_chunks: list[PrefillChunk] = []
        for chunk in longer:
            offset = len(ids)
            count = len(chunk.tokens)
            ids.extend(chunk.tokens)
            end = chunk.start + count
            blocks = torch.tensor(chunk.block_ids[: -(-end // bs)], dtype=torch.long, device=self.device)
            slots = (blocks[:, None] * bs + self._offsets).reshape(-1)
            slot_tensors.append(slots[chunk.start : end])
            mask = None
            if chunk.start:
                mask = torch.ones(count, end, dtype=torch.bool, device=self.device).tril(diagonal=chunk.start)
            prefill_chunks.append(PrefillChunk(offset, offset + count, blocks, end, mask))

        decode_group = None
        if decodes:
            lengths = [chunk.start + 1 for chunk in decodes]
            width = -(-max(lengths) // bs)
            table = [(chunk.block_ids + [0] * width)[:width] for chunk in decodes]
            read_blocks = torch.tensor(table, dtype=torch.long, device=self.device)
            mask = None
            if min(lengths) != width * bs:
                limits = torch.tensor(lengths, device=self.device)
                keys = torch.arange(width * bs, device=self.device)
                mask = (keys[None, :] < limits[:, None]).view(len(decodes), 1, 1, width * bs)
            decode_group = DecodeGroup(len(decodes), read_blocks, mask)

        with torch.inference_mode():
            embeds = self.embed_tokens(torch.tensor([ids], dtype=torch.long, device=self.device))
            hidden_size = self.hidden_size
            visual: list[tuple[int, torch.Tensor]] = []  # (packed row, features) for DeepStack
            offset = len(decodes)
            for chunk in longer:
                for row, rows in chunk.image_rows:
                    at = offset + row
                    embeds[0, at : at + rows.shape[0]] = rows[:, :hidden_size].to(embeds.dtype)
                    if self.deepstack:
                        visual.append((at, rows))
                offset += len(chunk.tokens)
            positions = self._positions(decodes, longer)
            extra: dict[str, Any] = {}
            if visual:
                # The model adds each vision layer's features at the visual positions, in order.
                visual.sort(key=lambda item: item[0])
                mask = torch.zeros(1, len(ids), dtype=torch.bool, device=self.device)
                for at, rows in visual:
                    mask[0, at : at + rows.shape[0]] = True
                features = torch.cat([rows for _, rows in visual]).to(embeds.dtype)
                extra["visual_pos_masks"] = mask
                extra["deepstack_visual_embeds"] = [
                    features[:, hidden_size * (1 + layer) : hidden_size * (2 + layer)]
                    for layer in range(self.deepstack)
                ]
            step = PagedStep(self.pool, torch.cat(slot_tensors), decode_group, prefill_chunks)
            with paged_attention.paged_step(step):
                hidden = self.language_model(
                    inputs_embeds=embeds, position_ids=positions, use_cache=False, **extra
                ).last_hidden_state
            last: list[int] = []
            offset = 0
            for chunk in ordered:
                offset += len(chunk.tokens)
                if chunk.sample:
                    last.append(offset - 1)
            logits = self.lm_head(hidden[0, last])
        # back to the caller's order
        order = [chunk for chunk in ordered if chunk.sample]
        wanted = [chunk for chunk in chunks if chunk.sample]
        if order != wanted:
            index = {id(chunk): row for row, chunk in enumerate(order)}
            logits = logits[[index[id(chunk)] for chunk in wanted]]
        return logits

    def _positions(self, decodes: list[ChunkInput], longer: list[ChunkInput]) -> torch.Tensor:
        """The packed tokens' positions, built on the CPU (where the prompts' M-RoPE positions
        are) and sent to the device in one copy."""
        if not self.uses_mrope:
            parts = [torch.tensor([chunk.start for chunk in decodes], dtype=torch.long)]
            parts += [torch.arange(c.start, c.start + len(c.tokens)) for c in longer]
            return torch.cat(parts).unsqueeze(0).to(self.device)
        columns: list[torch.Tensor] = []
        if decodes:
            rows = []
            for chunk in decodes:
                if chunk.start < chunk.prompt_len:
                    assert chunk.mrope is not None
                    rows.append(chunk.mrope[:, chunk.start].tolist())
                else:
                    rows.append([chunk.start + chunk.rope_delta] * 3)
            columns.append(torch.tensor(rows, dtype=torch.long).T)
        for chunk in longer:
            end = chunk.start + len(chunk.tokens)
            assert chunk.mrope is not None
            part = chunk.mrope[:, chunk.start : min(end, chunk.prompt_len)]
            if end > chunk.prompt_len:
                # generated tokens (recomputed after a preemption) sit at text positions on all axes
                later = torch.arange(max(chunk.start, chunk.prompt_len), end)
                part = torch.cat([part, (later + chunk.rope_delta).expand(3, -1)], dim=1)
            columns.append(part)
        return torch.cat(columns, dim=1).unsqueeze(1).to(self.device)

    def copy_block(self, source: int, target: int) -> None:
        self.pool.copy_block(source, target)
        self._zeroed[target] = 1

    def _zero_new_blocks(self, block_ids: list[int]) -> None:
        zeroed = self._zeroed
        bs = self.block_size
        for block in block_ids:
            if not zeroed[block]:
                zeroed[block] = 1
                for keys, values in zip(self.pool.keys, self.pool.values, strict=True):
                    keys[block * bs : (block + 1) * bs].zero_()
                    values[block * bs : (block + 1) * bs].zero_()
