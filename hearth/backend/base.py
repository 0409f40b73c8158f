"""The reference backend: every operation of the model in plain torch, on any device and dtype.

A backend is chosen once per engine (hearth/backend/__init__.py) and handed to the model when it
is built; the layers call its operations (norm, RoPE + cache write, attention, activation) and
never ask which device or dtype they run on. Once the weights are loaded, `prepare` gives every
weight kept in its storage format (a QuantTensor) the backend's module for it, kernel bound
(stored.py; here: dequantize-then-matmul). The runner gives it each step as host arrays
(`StepInputs`); the backend turns them into its own tensors and attention metadata, and runs the
model. The CPU and GPU backends subclass this one and replace the operations they have kernels
for; this one is the readable definition they are tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hearth.backend import state_ops
from hearth.backend.sparse_linear import ThresholdedLinear
from hearth.backend.state_ops import StateMetadata
from hearth.backend.stored import DequantLinear, QuantEmbedding, swap_stored_weights
from hearth.config import MAX_DECODE_QUERY_LEN, ModelConfig
from hearth.backend.transfer import move_module, release_unused_device_memory
from hearth.kv_format import KVCache, free_storages, read_rows, release_pages, restore_storages, write_rows
from hearth.quant.tensor import HALF_DTYPES, QuantTensor

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass
class StepInputs:
    """One step's batch on the host: S sequences' new tokens end to end (T rows)."""

    # int64 [T]; or a tensor on the backend's device: tokens a pass before drew and the host has not
    # read (a draft model's passes, draft_runner.DraftRunner.propose)
    input_ids: np.ndarray | torch.Tensor
    positions: np.ndarray  # int64 [T]; an M-RoPE model's [3, T] (time, height, width: ModelConfig.mrope_section)
    slot_mapping: np.ndarray  # int64 [T] cache slot of each new token's K/V
    query_start_loc: np.ndarray  # int32 [S + 1] sequence s owns rows [start[s], start[s + 1])
    seq_lens: np.ndarray  # int32 [S] tokens in the cache after this step (new ones included)
    block_tables: np.ndarray  # int32 [S, max_blocks] padded with 0
    block_size: int
    # Token trees (several speculative branches verified at once; None: every sequence causal).
    # tree_start int32 [S]: where each sequence's tree region begins (its rows see every position
    # before it); tree_masks int64 [T]: bit j set = the row sees position tree_start + j (its
    # ancestors and itself). A row's position is tree_start + its bits set - 1 (its depth), not its
    # slot's; a causal sequence has tree_start at its first new row and row r's bits 0..r.
    tree_start: np.ndarray | None = None
    tree_masks: np.ndarray | None = None
    # hybrid models: int32 [S] each sequence's slot in the state cache (None: the model keeps no state)
    state_slots: np.ndarray | None = None
    # hybrid models verifying guesses: int64 [S] the first slot of each sequence's snapshots, the states after
    # each of its rows but the last (state_ops.py; -1: none); None: no sequence keeps any
    state_snapshots: np.ndarray | None = None
    # rows whose input is given rather than looked up (an image's embeddings in place of its placeholder
    # tokens): their indices int64 [k] and values [k, hidden] on the backend's device; None: none
    embeds: tuple[np.ndarray, torch.Tensor] | None = None
    # images whose tokens attend to each other both ways (Gemma 3's; ModelConfig.bidirectional_images), those
    # among the step's new rows: int64 [N, 3] (sequence, first position, end position); None: all causal
    image_blocks: np.ndarray | None = None
    # the image blocks hold on the sliding-window layers only, the full layers causal (Gemma 4's)
    image_blocks_sliding_only: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def decode_only(self) -> bool:
        return len(self.input_ids) == self.num_seqs

    @property
    def last_rows(self) -> np.ndarray:  # int64 [S] the row of each sequence's last new token
        return self.query_start_loc[1:].astype(np.int64) - 1

    def sequences(self, first: int, end: int) -> StepInputs:
        """The step of sequences first..end-1 alone (their rows, in order)."""
        start, stop = int(self.query_start_loc[first]), int(self.query_start_loc[end])
        return self._of(slice(first, end), slice(start, stop), self.query_start_loc[first : end + 1] - start)

    def select(self, seqs: np.ndarray) -> StepInputs:
        """The step of the sequences seqs (int64 [k], in order) alone, their rows in order (no embeds)."""
        query_start_loc = np.concatenate(([0], np.cumsum(self.query_lens[seqs]))).astype(np.int32)
        return self._of(seqs, self.rows_of(seqs), query_start_loc)

    def rows_of(self, seqs: np.ndarray) -> np.ndarray:
        """The rows (int64) of the sequences seqs, in order."""
        return np.concatenate([np.arange(self.query_start_loc[s], self.query_start_loc[s + 1]) for s in seqs])

    def _of(self, seqs, rows, query_start_loc: np.ndarray) -> StepInputs:
        trees = self.tree_masks is not None
        return StepInputs(self.input_ids[rows], self.positions[..., rows], self.slot_mapping[rows], query_start_loc,
                          self.seq_lens[seqs], self.block_tables[seqs], self.block_size,
                          self.tree_start[seqs] if trees else None, self.tree_masks[rows] if trees else None,
                          None if self.state_slots is None else self.state_slots[seqs],
                          None if self.state_snapshots is None else self.state_snapshots[seqs])


@dataclass
class SaturationChecks:
    """CALM's hidden-state saturation checks inside a decode pass (hearth/model/calm.py): after each of
    `layers` (counts of the pass's layers, increasing, at least 1), each checked row's cosine of its
    residual stream there and a layer before; the pass stops after the first of them where some row's
    cosine reaches its threshold. The backend writes `stop` and `cosines`."""

    layers: np.ndarray  # int64
    thresholds: torch.Tensor  # float32 [T]: +inf, the row is not checked; -inf, the pass stops there whatever
    stop: int = 0  # the layers the pass ran
    cosines: torch.Tensor | None = None  # float32 [T], those at the stop (a row not checked: any value)


@dataclass
class DecodeSampling:
    """How a decode step draws its tokens inside the backend's step (Backend.decode_and_sample):
    the rows' sampling parameters and the head that turns logits into tokens, both the engine's
    sampler's (the backend keeps the parameters on its device and runs the head where it runs the
    model: for the gpu backend, inside the step's CUDA graph)."""

    params: np.ndarray  # float64 [num_params, S] per sequence
    defaults: tuple[float, ...]  # a padding row's parameters
    key: Hashable  # the head's variant (one captured graph per batch bucket and key)
    # (logits [B, V] float32, params [num_params, B] float64 on the device) -> tensors [B, ...]; no host reads
    head: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
    # every row takes its argmax (the head's (token ids, their log-probabilities): a backend may draw them with the
    # model's pass, in one kernel call)
    all_greedy: bool = False


@dataclass
class PrefillSequence:
    """A sequence with several new tokens this step (a prompt or a chunk of one)."""

    token_start: int  # first of its rows in the flattened batch
    token_end: int
    context_slots: torch.Tensor  # [context_len] cache slots of all its tokens so far, new ones included
    # [query_len, context_len] bool, True = may attend: causal, and both ways within an image (StepInputs.image_blocks)
    sees: torch.Tensor
    sliding_only: bool = False  # the images' blocks on sliding-window layers only (StepInputs.image_blocks_sliding_only)
    causal: bool = True  # no image blocks: `sees` is the causal mask

    def mask(self, window: int | None) -> torch.Tensor:
        """The mask, and with a sliding window only the positions after each row's last `window` (an image's
        later tokens included: transformers' sliding mask, Gemma 3's and Gemma 4's too); without one, where
        the images' blocks hold on sliding layers only, causal."""
        new, context = self.sees.shape
        rows = torch.arange(context - new, context, device=self.sees.device)[:, None]  # query positions
        columns = torch.arange(context, device=rows.device)[None, :]
        if window is None:
            return columns <= rows if self.sliding_only else self.sees
        return self.sees & (columns > rows - window)


@dataclass
class AttentionMetadata:
    """The reference and CPU backends' view of a step: prompts one by one, decodes (a few new
    rows per sequence) together."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V go
    prefills: list[PrefillSequence]
    decode_token_index: torch.Tensor  # [R] rows of the batch that belong to decodes, in order
    decode_query_start: torch.Tensor  # [D + 1] int32: decode d owns rows [start[d], start[d + 1]) of those R
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32, padded with 0
    decode_context_lens: torch.Tensor  # [D] int32, new tokens included
    decode_max_len: int
    block_size: int
    # token trees (StepInputs.tree_start / tree_masks) of the decodes: [D] int32 and [R] int64; None: causal
    decode_tree_start: torch.Tensor | None = None
    decode_tree_masks: torch.Tensor | None = None
    state: StateMetadata | None = None  # hybrid models: the sequences' state slots (hearth/backend/state_ops.py)

    @property
    def num_decodes(self) -> int:
        return self.decode_context_lens.numel()

    @classmethod
    def from_step(cls, step: StepInputs, device: torch.device) -> AttentionMetadata:
        prefills, decode_rows, decode_seqs = [], [], []
        both_ways = () if step.image_blocks is None else set(step.image_blocks[:, 0].tolist())
        for s, (start, end) in enumerate(zip(step.query_start_loc[:-1], step.query_start_loc[1:])):
            start, end = int(start), int(end)
            # a decode reads its context through the block table, causally (rows of an image: a prefill's mask)
            if end - start <= MAX_DECODE_QUERY_LEN and s not in both_ways:
                decode_rows.extend(range(start, end))
                decode_seqs.append(s)
                continue
            seq_len = int(step.seq_lens[s])
            blocks = step.block_tables[s, : -(-seq_len // step.block_size)].astype(np.int64)
            context = (blocks[:, None] * step.block_size + np.arange(step.block_size)).reshape(-1)[:seq_len]
            mask = _prefill_mask(seq_len, end - start, None if s not in both_ways else
                                 step.image_blocks[step.image_blocks[:, 0] == s, 1:])
            prefills.append(PrefillSequence(start, end, torch.from_numpy(context).to(device),
                                            torch.from_numpy(mask).to(device), step.image_blocks_sliding_only,
                                            causal=s not in both_ways))
        lens = step.seq_lens[decode_seqs]
        query_start = np.zeros(len(decode_seqs) + 1, dtype=np.int32)
        np.cumsum(step.query_lens[decode_seqs], out=query_start[1:])
        widest = -(-int(lens.max()) // step.block_size) if len(lens) else 0
        return cls(
            slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
            prefills=prefills,
            decode_token_index=torch.tensor(decode_rows, dtype=torch.long, device=device),
            decode_query_start=torch.from_numpy(query_start).to(device),
            decode_block_tables=torch.from_numpy(np.ascontiguousarray(step.block_tables[decode_seqs, :widest])).to(device),
            decode_context_lens=torch.from_numpy(lens).to(device),
            decode_max_len=int(lens.max()) if len(lens) else 0,
            block_size=step.block_size,
            decode_tree_start=None if step.tree_masks is None else torch.from_numpy(step.tree_start[decode_seqs]).to(device),
            decode_tree_masks=None if step.tree_masks is None else torch.from_numpy(step.tree_masks[decode_rows]).to(device),
            state=None if step.state_slots is None else StateMetadata.from_step(
                step.state_slots, step.query_start_loc, step.seq_lens, device, step.state_snapshots),
        )

    def decode_slots_and_mask(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """For the SDPA path, per decode row: cache slots [R, L] (its sequence's, padded) and
        [R, 1, 1, L] True where the row may attend (its sequence's context before its tree region,
        its tree masks' positions in it (causal: up to its own), and, given a sliding window, only
        its last `window` positions)."""
        if not hasattr(self, "_decode_slots"):  # every layer asks; built once a step
            offsets = torch.arange(self.block_size, device=self.decode_block_tables.device)
            slots = (self.decode_block_tables.long()[:, :, None] * self.block_size + offsets).flatten(1)
            query_lens = self.decode_query_start.diff().long()
            row_seq = torch.repeat_interleave(torch.arange(self.num_decodes, device=slots.device), query_lens)
            if self.decode_tree_masks is None:  # causal: row r of n sees the tree region's positions 0..r
                tree_start = (self.decode_context_lens.long() - query_lens)[row_seq]
                row_in_seq = torch.arange(len(row_seq), device=slots.device) - self.decode_query_start.long()[row_seq]
                masks = (2 << row_in_seq) - 1
            else:
                tree_start, masks = self.decode_tree_start.long()[row_seq], self.decode_tree_masks
            positions = torch.arange(self.decode_max_len, device=slots.device)
            offset = positions - tree_start[:, None]  # [R, L] from the row's tree region
            sees = (offset < 0) | ((masks[:, None] >> offset.clamp(0, 63)) & 1).bool() & (offset < 64)
            bits = (masks[:, None] >> torch.arange(64, device=slots.device)) & 1
            row_ends = tree_start + bits.sum(dim=1)  # one past each row's position
            self._decode_slots = slots[row_seq, : self.decode_max_len], sees, row_ends[:, None]
        slots, mask, ends = self._decode_slots
        if window is not None:
            mask = mask & (torch.arange(self.decode_max_len, device=slots.device) >= ends - window)
        return slots, mask[:, None, None, :]


def _prefill_mask(seq_len: int, query_len: int, images: np.ndarray | None) -> np.ndarray:
    """bool [query_len, seq_len] of a sequence's last query_len positions: causal, and where `images`
    (int64 [N, 2], each one's first and end position) gives them, every row of an image seeing the whole
    image (those of its tokens the cache holds by this step's end)."""
    first = seq_len - query_len  # position of the first new token
    rows, columns = np.arange(first, seq_len)[:, None], np.arange(seq_len)[None, :]
    mask = columns <= rows
    for low, high in () if images is None else images.tolist():
        mask |= (rows >= low) & (rows < high) & (columns >= low) & (columns < high)
    return mask


class Backend:
    """The reference path: torch's operations, any device, any dtype."""

    name = "reference"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    @property
    def weights_on_device(self) -> bool:
        """Whether a level-1 sleep moves the weights to host RAM (release_memory): where they lie in a GPU's."""
        return self.device.type != "cpu"

    def release_memory(self, model: nn.Module, kv_tensors: list[torch.Tensor]) -> tuple[int, list]:
        """A level-1 sleep's memory (ModelRunner.sleep): the KV cache's given back, its tensors kept (on a CPU
        the pages of `zeroed`'s maps, which read as zeros again and keep their addresses, kv_format.release_pages;
        off a CPU the storages freed, free_storages) and, where weights_on_device, the weights moved to host
        RAM (move_module), then the freed memory handed back to the driver. The bytes released, and the freed
        storages for restore_memory."""
        if self.device.type == "cpu":
            released, freed = release_pages(kv_tensors), []
        else:
            freed = free_storages(kv_tensors)
            released = sum(nbytes for _, nbytes in freed)
        if self.weights_on_device:
            released += move_module(model, torch.device("cpu"))
        release_unused_device_memory()
        return released, freed

    def restore_memory(self, model: nn.Module, freed: list) -> None:
        """Back from release_memory: the weights on the device again, the KV storages' memory back, zeroed."""
        if self.weights_on_device:
            move_module(model, self.device)
        restore_storages(freed)

    def takes_token_trees(self, config: ModelConfig) -> bool:
        """Whether decode rows may attend through StepInputs.tree_masks on this model (speculative token trees,
        contrastive search's candidates)."""
        return True

    def check_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """Raises ValueError where this backend cannot write and read a KV cache of `kv_cache_dtype`
        (kv_format.KV_CACHE_DTYPES); this one, torch's operations, can every one."""

    # ---- a step ------------------------------------------------------------------------

    def forward(self, model: nn.Module, step: StepInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:  # [T, hidden] after the final norm
        input_ids, positions, meta = self.inputs(model, step)
        embeds = None if step.embeds is None else (torch.from_numpy(step.embeds[0]).to(self.device), step.embeds[1])
        return model(input_ids, positions, kv_caches, meta, embeds)

    def decode_and_sample(self, model: nn.Module, step: StepInputs, kv_caches, sampling: DecodeSampling
                          ) -> tuple[torch.Tensor, ...] | None:
        """A decode step and its draws in one go, where the backend runs them together: the head's
        outputs [S, ...], or None (then the caller runs `forward` and its sampler)."""
        return None

    def inputs(self, model: nn.Module, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's token ids [T], positions [T] and attention metadata, on this backend's device."""
        dev = self.device
        return (torch.as_tensor(step.input_ids, device=dev), torch.from_numpy(step.positions).to(dev),
                AttentionMetadata.from_step(step, dev))

    # ---- the model's operations --------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
                 residual: torch.Tensor | None = None):
        """norm(x); or, given the residual stream, (norm(residual + x), residual + x)."""
        if residual is not None:
            residual = residual + x
            return self.rms_norm(residual, weight, eps, weight_offset), residual
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        if weight_offset:  # gemma: (1 + w) in float32, as transformers
            return (x * (weight.float() + weight_offset)).to(dtype)
        return weight * x.to(dtype)

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        """What rope_and_store_kv needs of this step's positions (looked up once, used by every
        layer): here (cos, sin) each [T, 1, head_dim / 2] in the compute dtype. cos and sin are the
        RotaryEmbedding's float32 tables [max_positions, head_dim / 2]."""
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)

    def rope_and_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary,
                          kv_cache: tuple[KVCache, KVCache], slot_mapping: torch.Tensor) -> torch.Tensor:
        """RoPE on q [T, heads, head_dim] and k [T, kv_heads, head_dim]; k and v written into their
        cache slots (quantized where the cache is: hearth/kv_format.py); returns q rotated."""
        k_cache, v_cache = kv_cache
        write_rows(k_cache, slot_mapping, apply_rope(k, rotary))
        write_rows(v_cache, slot_mapping, v)
        return apply_rope(q, rotary)

    def rope(self, q: torch.Tensor, rotary) -> torch.Tensor:
        """RoPE on q [T, heads, head_dim] alone (a layer that attends over another layer's cached K/V)."""
        return apply_rope(q, rotary)

    def attention(self, q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, meta: AttentionMetadata,
                  scale: float, softcap: float | None = None, window: int | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, heads, head_dim] rotated, this step's K/V already stored -> [T, heads, V's head_dim]
        (V may be narrower than K: multi-head latent attention's values are a view of its keys).
        softcap: scores become softcap * tanh(scores / softcap) before the softmax (gemma2).
        window: a query sees only the last `window` positions, itself included (sliding window).
        sinks: float32 [heads], a logit per head that joins each row's softmax and takes its share of
        the weight, with no value (gpt-oss's attention sinks)."""
        if not meta.prefills:  # decodes only (most steps): every row is a decode, in order
            return self.decode_attention(q, k_cache, v_cache, meta, scale, softcap=softcap, window=window, sinks=sinks)
        out = q.new_empty(*q.shape[:-1], v_cache.shape[-1])
        for seq in meta.prefills:
            out[seq.token_start : seq.token_end] = self.prefill_attention(
                q[seq.token_start : seq.token_end], k_cache, v_cache, seq, scale, softcap, window, sinks)
        if meta.num_decodes:
            out[meta.decode_token_index] = self.decode_attention(q[meta.decode_token_index], k_cache, v_cache, meta,
                                                                 scale, softcap=softcap, window=window, sinks=sinks)
        return out

    def prefill_attention(self, q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, seq: PrefillSequence,
                          scale: float, softcap: float | None = None, window: int | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One prefill's rows q [query_len, heads, head_dim] over its context (attention's arguments) ->
        [query_len, heads, V's head_dim]."""
        # [1, heads, query_len, head_dim] against [1, kv_heads, context_len, head_dim]
        query = q.transpose(0, 1).unsqueeze(0)
        keys = read_rows(k_cache, seq.context_slots, q.dtype).transpose(0, 1).unsqueeze(0)
        values = read_rows(v_cache, seq.context_slots, q.dtype).transpose(0, 1).unsqueeze(0)
        head_sinks = None if sinks is None else sinks.view(-1, 1, 1)  # [heads, 1, 1]
        return _attend(query, keys, values, seq.mask(window), scale, softcap, head_sinks)[0].transpose(0, 1)

    def decode_attention(self, q: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
                         meta: AttentionMetadata, scale: float, softcap: float | None = None,
                         window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The decodes' rows, q [R, heads, head_dim] (a sequence may have several: a verification's):
        one batched SDPA over padded gathers, a row at a time. The query heads that share a KV head
        are rows of one query (SDPA's own GQA copies K and V per query head: 7x the time for
        multi-head latent attention's one 576-wide KV head)."""
        # [R, kv_heads, heads / kv_heads, head_dim] against [R, kv_heads, L, head_dim]
        slots, mask = meta.decode_slots_and_mask(window)
        keys = read_rows(k_cache, slots, q.dtype).transpose(1, 2)
        values = read_rows(v_cache, slots, q.dtype).transpose(1, 2)
        grouped = q.reshape(q.shape[0], keys.shape[1], -1, q.shape[-1])
        group_sinks = None if sinks is None else sinks.view(keys.shape[1], -1, 1)  # [kv_heads, group, 1]
        return _attend(grouped, keys, values, mask, scale, softcap, group_sinks).reshape(*q.shape[:2], -1)

    def act_and_mul(self, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
        return _ACTIVATIONS[activation](gate) * up

    # the state layers' operations (hybrid models, state_ops.py): prompts and chunks in torch; the decodes'
    # steps (their states updated in place by slot) are what a backend replaces with kernels

    def causal_conv1d(self, x, state, weight, bias, meta: StateMetadata, activation: str | None = None):
        return state_ops.causal_conv1d(x, state, weight, bias, meta, activation, step=self.conv1d_step)

    def gated_delta_rule(self, q, k, v, g, beta, state, meta: StateMetadata):
        return state_ops.gated_delta_rule(q, k, v, g, beta, state, meta, step=self.delta_rule_step)

    def ssm_scan(self, q, k, v, g, state, meta: StateMetadata):
        return state_ops.ssm_scan(q, k, v, g, state, meta, step=self.ssm_step)

    def gated_delta_net_step(self, layer: nn.Module, qkv, z, b, a, state, meta: StateMetadata) -> torch.Tensor | None:
        """A Gated DeltaNet layer's (hearth/model/state_layers.py) work between in_proj and out_proj in one call, where
        a backend has a kernel for it and the step is all decodes: its outputs [T, value heads x value dim], its
        states updated in place; or None (then the layer's own ops run, on this backend's state operations)."""
        return None

    conv1d_step = staticmethod(state_ops.conv1d_step)
    delta_rule_step = staticmethod(state_ops.delta_rule_step)
    ssm_step = staticmethod(state_ops.ssm_step)

    @staticmethod
    def argmax_and_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy sampler's two reductions of logits [B, V] float32: each row's argmax int64 [B]
        (the first of equal maxima) and its log-sum-exp [B] (its log-softmax's normaliser)."""
        return logits.argmax(dim=-1), logits.logsumexp(dim=-1)

    @staticmethod
    def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """The sampler's grammar masks: in rows [R] of logits [B, V], tokens whose bit is clear in
        the row's bitmask [R, ceil(V/32)] int32 -> -inf (bit t of word t // 32). A new tensor."""
        V = logits.shape[-1]
        bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, :V].bool()  # [R, V]
        return logits.index_copy(0, rows, logits[rows].masked_fill(~allowed, float("-inf")))

    def run_experts(self, moe: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """A mixture-of-experts layer's chosen experts in one go, where a backend has kernels for it:
        x [P, hidden] rows grouped by expert (counts int64 [experts]: rows of each, in order) ->
        [P, hidden], or None (then each chosen expert's modules run on its rows)."""
        return None

    def decode_layers(self, model: nn.Module, x: torch.Tensor, rotary, kv_caches, meta,
                      exits: SaturationChecks | None = None):
        """A whole decode step through every layer in one call, where a backend has one: returns
        (the last layer's output, the residual stream) or None (then the modules run). A step whose
        rows use LoRA adapters (model.lora_rows active, hearth/model/lora.py) must add them, or decline.
        With exits, the pass stops where they say (exits.stop: its layers) or the backend declines."""
        return None

    # ---- weights -----------------------------------------------------------------------

    def prepare(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Once, after loading: every Linear and Embedding whose weight was left in its storage format
        (a QuantTensor) becomes this backend's module for that format, its kernel bound there; or,
        where the dense module is the better choice, takes its weight dense in `dtype`."""
        swap_stored_weights(model, lambda module, weight: self.stored_module(module, weight, dtype), dtype)

    def stored_module(self, module: nn.Module, weight: QuantTensor, dtype: torch.dtype) -> nn.Module | None:
        """This backend's module for `module` (a Linear, or an nn.Embedding) with `weight` kept as stored,
        or None for the dense module (the weight dequantized once, here). Dequantize-then-matmul, never
        activations rounded: a matrix dense in `dtype` on a CPU (where dequantizing tiles at every
        call would cost seconds a step) and wherever it is F16/BF16; GGUF blocks elsewhere stay blocks,
        dequantized a tile at a time (stored.py's DequantLinear). Embeddings stay as stored (only the
        rows looked up are dequantized), but F16/BF16 ones off a CPU or already of the compute dtype."""
        half = weight.qtype in HALF_DTYPES
        if isinstance(module, nn.Embedding):
            return None if half and (self.device.type != "cpu" or HALF_DTYPES[weight.qtype] == dtype) else \
                QuantEmbedding(weight, dtype)
        if self.device.type == "cpu" or half:
            return None
        return DequantLinear(weight, module.bias)

    def sparse_linear(self, module: nn.Module, threshold: float) -> nn.Module:
        """The projection `module` with activation sparsity: its input's activations with |x| < threshold
        zeroed first (docs/sparsity.md); here the masked input through the module itself."""
        return ThresholdedLinear(module, threshold)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of query [B, heads, Q, D] over keys / values [B, kv_heads, K, D] where mask (True:
    may attend) allows: SDPA, or with soft-capped scores or sinks (a logit per query row's head,
    broadcast to [B, heads, Q, 1], in the softmax with no value) the same written out (SDPA has neither)."""
    gqa = query.shape[1] != keys.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = query @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(query.dtype) @ values
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(query.dtype) @ values


def apply_rope(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, head_dim] with (cos, sin) each [T, 1, head_dim / 2]."""
    cos, sin = rotary
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)
    return out
