"""Attention over the paged KV pool, for one engine step that packs every scheduled token of
every request into a single sequence (batch 1, T tokens).

The model's attention layers call `paged_attention` (registered with transformers'
AttentionInterface under `PAGED_ATTENTION`) with the step's queries, keys and values. It writes the
new keys/values into the pool at each token's slot, then attends each request's queries to its own
slots only: decodes (one query each) together, padded to the longest context; prompt chunks one
request at a time with a causal mask shifted by what the request already computed. Outside an
engine step (the vision tower, `model.generate`) it is plain SDPA, so the model stays usable.

Why not transformers' own `generation.continuous_batching`: it batches text models from token
ids (no per-request image embeddings or M-RoPE positions) and keeps its own block manager, while
this pool's blocks are also the prefix cache whose events the router mirrors. Its attention hook
is the part that fits, and is what this module uses. Measured on the demo model, one CPU thread:
a decode step of 8 requests costs about what the plain forward with a DynamicCache costs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

PAGED_ATTENTION = "mmr_paged"


class KvPoolTensors:
    """The pool's storage: per layer, keys and values shaped [blocks * block_size, kv_heads, head_dim]
    (a token's slot is `block * block_size + offset`), read back a block table at a time."""

    def __init__(
        self,
        *,
        layers: int,
        blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        zeroed: bool = False,
    ) -> None:
        slots = blocks * block_size
        # On a CPU empty, not zeros: memory is touched (and counted) as blocks come into use, and
        # the runner zeroes each block on first use. `zeroed`: all at once (a GPU writes the
        # whole pool in milliseconds, where a block at a time costs kernel launches every step).
        shape = (slots, kv_heads, head_dim)
        allocate = torch.zeros if zeroed else torch.empty
        self.keys = [allocate(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [allocate(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.block_size = block_size

    def copy_block(self, source: int, target: int) -> None:
        bs = self.block_size
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[target * bs : (target + 1) * bs] = keys[source * bs : (source + 1) * bs]
            values[target * bs : (target + 1) * bs] = values[source * bs : (source + 1) * bs]


@dataclass
class DecodeGroup:
    """Requests feeding one token each: attended together, keys padded to the longest context."""

    count: int  # B: they are the packed sequence's first B tokens
    read_blocks: torch.Tensor  # [B, N] each request's block table, padded (with block 0)
    mask: torch.Tensor | None  # [B, 1, 1, N * block_size] True where a key is real


@dataclass
class PrefillChunk:
    """One request's chunk of several tokens, at packed positions [start, end)."""

    start: int
    end: int
    read_blocks: torch.Tensor  # [N] its block table, as far as the chunk reaches
    context: int  # tokens of context up to the chunk's last token
    mask: torch.Tensor | None  # [n, L] causal mask shifted by the computed prefix; None: plain causal


@dataclass
class PagedStep:
    """What one forward pass needs to place and read each request's keys and values."""

    pool: KvPoolTensors
    write_slots: torch.Tensor  # [T] the slot of every packed token
    decodes: DecodeGroup | None
    chunks: list[PrefillChunk]


_current = threading.local()


class paged_step:
    """Makes `step` the one the calling thread's attention layers use, for one forward pass."""

    def __init__(self, step: PagedStep) -> None:
        self._step = step

    def __enter__(self) -> PagedStep:
        _current.step = self._step
        return self._step

    def __exit__(self, *exc: object) -> None:
        _current.step = None


def current_step() -> PagedStep | None:
    return getattr(_current, "step", None)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    step = current_step()
    if step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = module.layer_idx
    keys, values = step.pool.keys[layer], step.pool.values[layer]
    # [1, heads, T, dim] -> [T, heads, dim], the pool's layout
    keys.index_copy_(0, step.write_slots, key[0].transpose(0, 1))
    values.index_copy_(0, step.write_slots, value[0].transpose(0, 1))
    q = query[0]  # [heads, T, dim]
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)
    block_size = step.pool.block_size
    paged_keys = keys.view(-1, block_size, *keys.shape[1:])  # [blocks, block_size, kv_heads, dim]
    paged_values = values.view(-1, block_size, *values.shape[1:])
    decodes = step.decodes
    if decodes is not None:
        count, blocks = decodes.read_blocks.shape
        # [heads, B, dim] -> [B, heads, 1, dim]; keys [B, N, bs, kv_heads, dim] -> [B, kv_heads, N*bs, dim]
        dq = q[:, :count].transpose(0, 1).unsqueeze(2)
        flat = (count, blocks * block_size, *keys.shape[1:])
        dk = paged_keys[decodes.read_blocks].view(flat).transpose(1, 2)
        dv = paged_values[decodes.read_blocks].view(flat).transpose(1, 2)
        attended = torch.nn.functional.scaled_dot_product_attention(
            dq, dk, dv, attn_mask=decodes.mask, scale=scaling, enable_gqa=True
        )
        out[:count] = attended[:, :, 0, :]
    for chunk in step.chunks:
        cq = q[:, chunk.start : chunk.end].unsqueeze(0)
        ck = paged_keys[chunk.read_blocks].view(-1, *keys.shape[1:])[: chunk.context]
        cv = paged_values[chunk.read_blocks].view(-1, *keys.shape[1:])[: chunk.context]
        ck = ck.transpose(0, 1).unsqueeze(0)
        cv = cv.transpose(0, 1).unsqueeze(0)
        attended = torch.nn.functional.scaled_dot_product_attention(
            cq, ck, cv, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scaling, enable_gqa=True
        )
        out[chunk.start : chunk.end] = attended[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _paged_mask(*args: Any, **kwargs: Any) -> Any:
    # Inside an engine step the attention reads positions from the step: no mask is built (a
    # T x T mask over the packed sequence would be wrong and large). Elsewhere, SDPA's.
    if current_step() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def install(model: Any) -> None:
    """Routes the text model's attention through `paged_attention` (the vision tower keeps its own)."""
    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
    AttentionMaskInterface.register(PAGED_ATTENTION, _paged_mask)
    assert PAGED_ATTENTION in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    model.config.get_text_config()._attn_implementation_internal = PAGED_ATTENTION
