"""Decode steps in one C++ call: the CPU path for models whose matmuls all run the CPU matmul kernels.

At batch 1 on a CPU a TinyLlama layer's matmuls take ~650 us, and the ~25 torch ops and module
calls around them (norms, RoPE, cache writes, attention, splits, SiLU) about a third as much
again: each runs with the caches that the weights' stream has just emptied. When every projection
of every layer is an Int8Linear (any GGUF block format, in place or packed;
hearth/backend/cpu_linear.py) or a HalfLinear on half_matmul (F16 / BF16 arrays: the built-in model and its draft,
whose steps are otherwise mostly Python) and the model is llama-shaped (SiLU MLP, no experts, no biases,
q/k norms per head if any, no sandwich norms, one window for every layer if any, RoPE in every layer;
K/V in float32, float16 or q8_0), a step made only of decodes (sequences with a few new
tokens each: a plain decode's one, a verification's guesses and the token before them;
config.MAX_DECODE_QUERY_LEN) runs cpu_kernels/'s `decode_layers`: the kernels that the modules
call, in the same order, with no Python between them. Qwen3.5's layers run there too (a hybrid model
whose layers are attention and Gated DeltaNet, in steps of one row a sequence): its gated attention (q/k
norms, partial RoPE, the output gate) and its Gated DeltaNet layers (in_proj, the gated_delta_net_step
kernel on the layer's states in place, out_proj), each layer's kind and operands a row of the mixer
table (mixer_row); at batch 1 its ~290 module calls a step were ~14 ms against llama.cpp's ~70 ms step. A merged
projection whose parts come in different formats (llama.cpp's Q4_K_M keeps some v and down
projections in Q6_K) runs part by part into its columns. A projection with activation sparsity
(hearth/backend/sparse_linear.py's SparseColumnsLinear or SparseBlocksLinear) runs hearth/quant/kernels'
sparse_matmul on its re-laid-out weight, for steps of up to SPARSE_MAX_ROWS rows (more: the modules'
path, where F16 takes torch's GEMM). With LoRA adapters (hearth/model/lora.py: every projection a
LoraLinear around the backend's module) the layer table takes the base modules' weights and a LoRA
table the wrappers' A and B; a step whose rows use adapters passes each row's slot, and after each
part's matmul the kernel adds each row's own adapter's term (cpu_kernels/lora.cpp). Every other step
and model takes the modules' path.

A draft model's greedy chain of passes (DraftRunner.propose, every row taking the argmax of its
logits as they come) runs `greedy_passes` where the model's embedding is in a format hearth/quant/kernels'
dequantize_rows reads and its lm_head is on the matmul kernels: the k passes in one call, each
pass `decode_layers`, the final norm, lm_head and argmax of each sequence's last row, and the
embeddings of those tokens as the next pass's rows; the host reads the k x rows token ids once.
"""

from __future__ import annotations

import numpy as np
import torch

from hearth.backend.base import AttentionMetadata, SaturationChecks, StepInputs
from hearth.backend.cpu_linear import INT8_QTYPES, HalfLinear, Int8Linear
from hearth.backend.cpu_ops import DECODE_SPLIT_LEN, float32_contiguous, tree_pointers, whole_caches_format
from hearth.backend.sparse_linear import SPARSE_MAX_ROWS, SparseLinear
from hearth.backend.stored import QuantEmbedding
from hearth.config import ATTENTION, GATED_DELTA_NET, MAX_DECODE_QUERY_LEN
from hearth.kv_format import data_pointers
from hearth.quant import kernels as quant_kernels
from hearth.quant.tensor import HALF_DTYPES

MIXER_KINDS = {"Attention": ATTENTION, "GatedDeltaNet": GATED_DELTA_NET}  # the mixers the kernel runs, by class
PART_FIELDS = 5  # cpu_kernels/cpu_kernels.h's: weight, packed terms or 0, qtype, output rows, threshold pointer or 0


class CpuDecodePath:
    """Runs a decode-only step of `model` through every layer in one kernel call."""

    def __init__(self, model, kernels, tables: tuple[torch.Tensor, torch.Tensor], matmul_addresses: tuple[int, int],
                 vocabulary: tuple | None, lora_table: torch.Tensor | None = None):
        config = model.config
        self.kernels = kernels
        # int64 [layers, LAYER_FIELDS]: weight pointers, fixed at load; int64 [layers, MIXER_FIELDS]: each
        # layer's attention or Gated DeltaNet (mixer_row)
        self.layer_table, self.mixer_table = tables
        layer_table = self.layer_table
        # the layers whose caches are a state layer's (conv window, delta rule state), not K/V
        self.state_layers = [i for i, layer in enumerate(model.layers)
                             if MIXER_KINDS.get(type(getattr(layer, layer.mixer_name)).__name__) != ATTENTION]
        # with LoRA adapters: int64 [layers, LORA_PART_ROWS, LORA_FIELDS], the wrappers' A and B (fixed
        # buffers, filled and emptied in place), and the model's LoraRows (each step's rows' slots)
        self.lora_table, self.lora_rows = lora_table, getattr(model, "lora_rows", None)
        self.matmul_addresses = matmul_addresses  # int8_matmul's and sparse_matmul's
        # a model with sparse projections: most rows of a step (its kernel skips columns only for a few)
        thresholds = layer_table[:, 2 + PART_FIELDS - 1::PART_FIELDS]  # after the two norms, each part's last field
        self.max_tokens = SPARSE_MAX_ROWS if thresholds.any() else None
        self.vocabulary = vocabulary  # greedy_passes' operands of the embedding, final norm and lm_head, or None
        self.shape = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                      config.intermediate_size)
        self.eps, self.norm_offset = config.rms_norm_eps, config.norm_weight_offset
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5  # (Attention.scale)
        self.window = config.sliding_window or 0  # every layer's (for_model takes no per-layer windows)
        # the KV caches last run and kernel_caches' operands for them: a runner passes the same caches
        # every step, and a small model's step is short enough for their checks to show
        self._caches: tuple[list, tuple[torch.Tensor, int] | None] | None = None

    @classmethod
    def for_model(cls, model, kernels) -> CpuDecodePath | None:
        """The path for `model` (kernels: cpu_kernels/ built), or None where it does not apply
        (see the module's docstring)."""
        qmatmul = quant_kernels.extension()
        config = model.config
        if (qmatmul is None or model.dtype != torch.float32 or not model.norm.weight.is_cpu
                or config.hidden_act != "silu" or config.qk_norm == "all" or config.attention_bias
                or config.head_dim % 2 or config.head_dim > 1024 or config.num_experts or config.sandwich_norms
                or config.sliding_layers is not None or config.no_rope_layers or config.kv_lora_rank
                or not config.uniform_kv_cache or not {*config.layer_types} <= {ATTENTION, GATED_DELTA_NET}):
            return None
        rows, lora_parts, mixers = [], [], []
        formats = [getattr(torch, name) for name in kernels.LORA_FORMATS]
        for layer in model.layers:
            mixer = getattr(layer, layer.mixer_name)
            kind = MIXER_KINDS.get(type(mixer).__name__)  # (hearth/model's classes: the backend imports none)
            mixers.append(mixer_row(kind, mixer, kernels.MIXER_FIELDS))
            if mixers[-1] is None:
                return None
            projections = ((mixer.in_proj.parts, [mixer.out_proj]) if kind == GATED_DELTA_NET
                           else (mixer.qkv_proj.parts, [mixer.o_proj]))
            projections += (layer.mlp.gate_up_proj.parts, [layer.mlp.down_proj])
            row = [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()]
            for parts, most in zip(projections, kernels.PROJECTION_PARTS):
                if len(parts) > most:
                    return None
                lora_parts += [lora_operands(part, kernels.MAX_LORA_PARTS, formats) for part in parts]
                lora_parts += [[0] * kernels.LORA_FIELDS] * (most - len(parts))
                parts = [getattr(part, "lora_base", part) for part in parts]  # a LoRA wrapper's base module
                weights = [kernel_weight(part) for part in parts]
                if None in weights:
                    return None
                for part, weight in zip(parts, weights):  # weight or packed codes, packed terms or 0, qtype,
                    # output rows, the threshold's pointer or 0
                    row += [*weight, part.out_features, getattr(part, "threshold_pointer", 0)]
                row += [0] * PART_FIELDS * (most - len(parts))
            rows.append(row)
        table = torch.tensor(rows, dtype=torch.int64)
        if table.shape[1] != kernels.LAYER_FIELDS:
            raise RuntimeError("cpu_kernels/'s layer table has other columns than cpu_decode.py fills")
        addresses = (qmatmul.module.int8_matmul_address(), qmatmul.module.sparse_matmul_address())
        # (a wrapper the table cannot take, or a hybrid model's: None, and a step with adapters takes the modules' path)
        lora_table = None if None in lora_parts or config.is_hybrid else torch.tensor(
            lora_parts, dtype=torch.int64).view(len(rows), -1, kernels.LORA_FIELDS)
        vocabulary = None if config.is_hybrid else vocabulary_operands(model, qmatmul)  # (a draft's states: not read)
        return cls(model, kernels, (table, torch.tensor(mixers, dtype=torch.int64)), addresses, vocabulary, lora_table)

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden] embeddings of a step whose every sequence is a decode (a few rows each)
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        exits: SaturationChecks | None = None,  # CALM's checks (cpu_kernels.h's ExitOperand), stop and cosines written
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's MLP output, the residual stream before it), or None where this step's
        tensors do not fit the kernel (then the modules run it)."""
        caches = self._kernel_caches(kv_caches)
        if (not (x.is_cpu and x.dtype == torch.float32 and meta.slot_mapping.dtype == torch.int64) or caches is None
                or (self.max_tokens is not None and x.shape[0] > self.max_tokens)):
            return None
        states = (0, 0)  # a hybrid model's state slots (int64 [T]) and fresh flags (bool [T]): one row a sequence
        if self.state_layers:
            if meta.state.single_rows.numel() != x.shape[0] or not meta.state.single_slots.is_cpu:
                return None
            states = (meta.state.single_slots.data_ptr(), meta.state.single_fresh.data_ptr())
        lora = self._lora_operands(x.shape[0])
        if lora is False:
            return None
        cache_table, kv_format = caches
        hidden, heads, kv_heads, head_dim, intermediate = self.shape
        tokens = x.shape[0]
        residual = x.contiguous()
        delta = torch.empty_like(residual)
        cos, sin = (t.contiguous() for t in rotary)
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        threads = torch.get_num_threads()
        checks = None
        if exits is not None:
            exits.cosines = torch.empty(tokens)
            checks = np.array([len(exits.layers), exits.layers.ctypes.data, exits.thresholds.data_ptr(),
                               exits.cosines.data_ptr()], dtype=np.int64)
        stop = self.kernels.decode_layers(
            *self.matmul_addresses, self.layer_table.data_ptr(), self.mixer_table.data_ptr(), cache_table.data_ptr(), kv_format,
            self.layer_table.shape[0], residual.data_ptr(), delta.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            meta.slot_mapping.data_ptr(), tables.data_ptr(), lens.data_ptr(), meta.decode_query_start.data_ptr(),
            *tree_pointers(meta), 0 if lora is None else lora.ctypes.data, 0 if checks is None else checks.ctypes.data,
            meta.num_decodes, tokens, hidden, heads, kv_heads, head_dim, intermediate, self.eps, meta.block_size,
            tables.shape[1], self.scale,
            DECODE_SPLIT_LEN, self.window, *states, self.norm_offset, threads,
        )
        if exits is not None:
            exits.stop = stop
        return delta, residual

    def greedy_passes(self, first: StepInputs, later: StepInputs | None, feeds: list[list[int]], rope,
                      kv_caches, logprobs: torch.Tensor | None = None) -> torch.Tensor | None:
        """Greedy passes in one kernel call (cpu_kernels/'s greedy_passes: a draft model's chain, or the
        model's own greedy decode step): the first pass's sequences (decodes: a few rows each, causal), then
        pass 1 + p of `feeds[p]`'s rows, laid out end to end in `later` (a row each, causal), row i fed the
        token pass p chose at its row feeds[p][i]; rope: the model's RotaryEmbedding. Returns the passes'
        choices end to end, a tensor int64 [their sequences]: the argmax of each sequence's last-row logits;
        their log-probabilities written to `logprobs` (a tensor float32 [the same]) where given. None where the kernel does
        not run these (then the modules do)."""
        caches = self._kernel_caches(kv_caches)
        steps = [first] if later is None else [first, later]
        if (self.vocabulary is None or caches is None or any(step.tree_masks is not None for step in steps)
                or (not first.decode_only and first.query_lens.max() > MAX_DECODE_QUERY_LEN)
                or (self.max_tokens is not None and max(first.positions.shape[-1], *map(len, feeds)) > self.max_tokens)):
            return None
        hidden, heads, kv_heads, head_dim, intermediate = self.shape
        threads = torch.get_num_threads()
        positions = first.positions if later is None else np.concatenate((first.positions, later.positions), axis=-1)
        cos, sin, rope_rows = rope.tables(positions)
        rope_rows = np.ascontiguousarray(rope_rows, dtype=np.int64)

        tokens = first.positions.shape[-1]
        # a pass's row of cpu_kernels/'s pass table (PassField): pointers, then counts
        rows = [(first.slot_mapping.ctypes.data, first.block_tables.ctypes.data, first.seq_lens.ctypes.data,
                 first.query_start_loc.ctypes.data, rope_rows.ctypes.data, 0, first.num_seqs, tokens,
                 first.block_tables.shape[1], DECODE_SPLIT_LEN)]
        feeds = [np.asarray(f, dtype=np.int64) for f in feeds]
        if later is not None:
            one_row_each = np.arange(max(map(len, feeds)) + 1, dtype=np.int32)  # a later pass's query starts
            slots, tables, lens = (a.ctypes.data for a in (later.slot_mapping, later.block_tables, later.seq_lens))
            width, start = later.block_tables.shape[1], 0  # start: the pass's first sequence (and row) in `later`
            for f in feeds:
                n, row = len(f), tokens + start
                rows.append((slots + 8 * start, tables + 4 * width * start, lens + 4 * start, one_row_each.ctypes.data,
                             rope_rows.ctypes.data + 8 * row, f.ctypes.data, n, n, width, DECODE_SPLIT_LEN))
                start += n
        table = np.array(rows, dtype=np.int64)
        if table.shape[1] != self.kernels.PASS_FIELDS:
            raise RuntimeError("cpu_kernels/'s pass table has other columns than cpu_decode.py fills")
        choices = torch.empty(first.num_seqs + sum(map(len, feeds)), dtype=torch.int64)
        ids = first.input_ids  # (a tensor where the step before's draws were fed in: engine/overlap.py)
        if isinstance(ids, torch.Tensor):
            ids = ids.contiguous().numpy()
        cache_table, kv_format = caches
        self.kernels.greedy_passes(
            *self.matmul_addresses, self.vocabulary[0], self.layer_table.data_ptr(), self.mixer_table.data_ptr(),
            cache_table.data_ptr(), kv_format,
            self.layer_table.shape[0], table.ctypes.data, len(table), ids.ctypes.data, choices.data_ptr(),
            0 if logprobs is None else logprobs.data_ptr(), *self.vocabulary[1:], cos.data_ptr(), sin.data_ptr(), len(cos),
            hidden, heads, kv_heads, head_dim, intermediate, self.eps, first.block_size,
            self.scale, self.window, threads,
        )
        return choices

    def _lora_operands(self, tokens: int) -> np.ndarray | None | bool:
        """decode_layers' LoRA operands (int64 [LORA_OPERANDS]) for a step of `tokens` rows, None where no
        row has an adapter, False where the kernel cannot run the step's adapters (then the modules do)."""
        rows = self.lora_rows
        if rows is None or not rows.active:
            return None
        if self.lora_table is None or len(rows.row_slots) != tokens:
            return False
        return np.array([self.lora_table.data_ptr(), rows.row_slots.ctypes.data, rows.slot_scales.ctypes.data,
                         rows.rank, len(rows.slot_scales)], dtype=np.int64)

    def _kernel_caches(self, kv_caches) -> tuple[torch.Tensor, int] | None:
        """kernel_caches(kv_caches), kept while the runner passes the same caches."""
        if self._caches is None or self._caches[0] is not kv_caches:
            self._caches = kv_caches, kernel_caches(kv_caches, self.state_layers)
        return self._caches[1]


def vocabulary_operands(model, qmatmul) -> tuple | None:
    """greedy_passes' operands for the model's embedding, final norm and lm_head: hearth/quant/kernels'
    dequantize_rows, the embedding table (pointer, bytes per row, qtype), the norm's weight, and
    lm_head's int8_matmul operands (weight, terms or 0, qtype, rows). None where the kernel cannot
    run them: a dense embedding or one in a format dequantize_rows does not read, an lm_head off the
    matmul kernels or with rows the embedding lacks (a token it chose would have no next row), a
    scaled embedding, soft-capped logits."""
    embedding, config = model.embed_tokens, model.config
    head = kernel_weight(model.lm_head)
    if (not isinstance(embedding, QuantEmbedding) or not embedding.qweight.is_cpu
            or embedding.qtype not in (*INT8_QTYPES, *HALF_DTYPES) or head is None
            or model.lm_head.out_features > embedding.num_embeddings
            or config.embedding_scale != 1.0 or config.final_logit_softcapping is not None):
        return None
    return (qmatmul.module.dequantize_rows_address(), embedding.qweight.data_ptr(), embedding.qweight.shape[1],
            int(embedding.qtype), model.norm.weight.data_ptr(), *head, model.lm_head.out_features)


def lora_operands(part, most: int, formats: list[torch.dtype]) -> list[int] | None:
    """A part's row of decode_layers' LoRA table: a LoraLinear's (hearth/model/lora.py) A and B pointers
    pointers, their format (an index in `formats`, the kernel's LoraFormat) and the output sizes of the
    projections it holds (`most` at most); zeros for another module; None for a wrapper the kernel cannot
    run (more projections, matrices in another dtype or off the CPU)."""
    if not hasattr(part, "lora_a"):
        return [0] * (3 + most)
    if len(part.out_sizes) > most or part.lora_a.dtype not in formats or not part.lora_a.is_cpu:
        return None
    return [part.lora_a.data_ptr(), part.lora_b.data_ptr(), formats.index(part.lora_a.dtype), *part.out_sizes,
            *[0] * (most - len(part.out_sizes))]


def kernel_caches(kv_caches, state_layers: list[int]) -> tuple[torch.Tensor, int] | None:
    """(int64 [layers, 4]: each layer's K and V cache, then their q8_0 scales (0: not q8_0), and
    their KVFormat, every layer's the same; a state layer's (state_layers) its convolution's and delta
    rule's states, float32); None where a cache is not one the kernel reads."""
    states = set(state_layers)
    attention = [caches for i, caches in enumerate(kv_caches) if i not in states]
    formats = {whole_caches_format(k, v) for k, v in attention}
    if len(formats) != 1 or None in formats or not all(
            t.dtype == torch.float32 and t.is_contiguous() and t.is_cpu for i in states for t in kv_caches[i]):
        return None
    pointers = [(kv_caches[i][0].data_ptr(), kv_caches[i][1].data_ptr(), 0, 0) if i in states else
                (lambda k, v: (k[0], v[0], k[1], v[1]))(*map(data_pointers, kv_caches[i])) for i in range(len(kv_caches))]
    return torch.tensor(pointers, dtype=torch.int64), formats.pop()


def mixer_row(kind: str, mixer, fields: int) -> list[int] | None:
    """A layer's row of decode_layers' mixer table (cpu_kernels.h's MixerField) for its mixer of `kind`
    (hearth/model's Attention or GatedDeltaNet), or None where the kernel cannot run it."""
    if kind == GATED_DELTA_NET:
        bound = delta_net_weights(mixer)
        if not bound:
            return None
        conv, taps, a_log, dt_bias, norm, _eps, *shape = bound
        row = [1, 0, 0, 0, 0, conv, taps, a_log, dt_bias, norm, *map(int, shape)]
    elif kind == ATTENTION and not (mixer.shares_kv or mixer.sinks is not None or mixer.softcap
                                                or mixer.value_norm_eps is not None):
        order = mixer.rope_order
        norms = (mixer.q_norm.weight, mixer.k_norm.weight) if mixer.qk_norm else ()
        if not float32_contiguous(*norms):  # (their weight offset: the model's, as every norm's)
            return None
        row = [0, *(w.data_ptr() for w in norms), *[0] * (2 - len(norms)), 0 if order is None else order.data_ptr(),
               int(mixer.output_gate)]
    else:
        return None
    return row + [0] * (fields - len(row))


def kernel_weight(module) -> tuple[int, int, int] | None:
    """The matmul kernels' weight operands for `module` (weight or packed codes pointer, packed terms
    pointer or 0, the type the kernel reads), or None where the kernels cannot run it (not an Int8Linear, a HalfLinear or a
    sparse module, or with a bias)."""
    if not isinstance(module, (Int8Linear, HalfLinear, SparseLinear)) or module.bias is not None:
        return None
    return module.kernel_weight


def on_int8_kernel(module) -> bool:
    """An Int8Linear (a block format, not F16/BF16), without bias."""
    return isinstance(module, Int8Linear) and module.bias is None


def delta_net_weights(layer) -> tuple:
    """gated_delta_net_step's arguments that a Gated DeltaNet layer fixes: its convolution's weight and taps,
    A_log, dt_bias, its norm's weight and eps, then its key and value heads, key and value dims, and whether
    value heads tile key heads; () where the kernel does not take its weights (then the layer's torch ops run)."""
    conv_weight = layer.conv1d.weight[:, 0]
    weights = (conv_weight, layer.A_log, layer.dt_bias, layer.norm.weight)
    if not float32_contiguous(*weights) or layer.norm.weight_offset or max(layer.key_dim, layer.value_dim) > 1024:
        return ()
    return (conv_weight.data_ptr(), conv_weight.shape[1], layer.A_log.data_ptr(), layer.dt_bias.data_ptr(),
            layer.norm.weight.data_ptr(), layer.norm.eps, layer.key_heads, layer.value_heads, layer.key_dim,
            layer.value_dim, layer.tiled)
