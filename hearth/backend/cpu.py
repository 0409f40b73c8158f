"""The CPU backend: float32 on a CPU through the C++ kernels of cpu_kernels/ (built on first use by hearth/native.py).

Decode attention (a few new rows per sequence: decodes, verifications of guesses) reads K/V in
place through the block tables and, when sequences x KV heads
would leave threads idle, splits long contexts and merges the splits by log-sum-exp
(flash-decoding; docs/benchmarks.md, "Decode attention"). RMSNorm with the residual add, and RoPE
with the K/V cache write, are one call each. A float16 or q8_0 KV cache (hearth/kv_format.py) is rounded or
quantized by that write and widened row by row inside the decode kernel. Weights kept in their
storage format run hearth/quant/kernels' C++ kernels (cpu_linear.py, bound once by `prepare`). Where every
matmul is on them, a step of decodes only runs all layers in one call (cpu_decode.py); a mixture of
experts on it runs its chosen experts in one call per projection (cpu_experts.py). A prompt's attention
runs the causal prefill kernel over its gathered K/V (blocks past each row's position never computed); an
image's both-ways blocks take the reference path (SDPA). Chosen only where the
kernels built and the compute dtype is float32.
"""

from __future__ import annotations

import numpy as np
import torch

from hearth.backend.base import AttentionMetadata, Backend, PrefillSequence
from hearth.backend.cpu_decode import CpuDecodePath, delta_net_weights
from hearth.backend.cpu_experts import GroupedExperts
from hearth.backend.cpu_linear import INT8_QTYPES, cpu_linear
from hearth.backend.cpu_ops import DECODE_SPLIT_LEN, cpu_kernels, float32_contiguous, tree_pointers, whole_caches_format
from hearth.backend.sparse_linear import SparseBlocksLinear, SparseColumnsLinear
from hearth.backend.stored import QuantEmbedding
from hearth.quant import kernels as quant_kernels
from hearth.kv_format import data_pointers, read_rows


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self):
        super().__init__("cpu")
        self.kernels = cpu_kernels()
        if self.kernels is None:
            raise RuntimeError("hearth's CPU kernels could not be built")
        # apply_token_bitmask's output, kept from step to step: a fresh [B, V] each step costs a page
        # fault per 4 KiB (the allocator hands such sizes back to the OS), ~4 ms at 32 x 49,152
        self._masked_logits = torch.empty(0)

    def stored_module(self, module, weight, dtype):
        """GGUF blocks and F16/BF16 matrices multiplied by hearth/quant/kernels' C++ kernels (cpu_linear.py);
        embeddings as the reference's, but the rows looked up in a block format widened by those kernels'
        own decoding (bit-exact, one call: torch's dequantizer is ~0.1-0.2 ms a decode step)."""
        if isinstance(module, torch.nn.Embedding):
            ext = quant_kernels.extension()
            if ext is not None and weight.qtype in INT8_QTYPES:
                return QuantEmbedding(weight, dtype, ext.dequantize_rows)
            return super().stored_module(module, weight, dtype)
        return cpu_linear(weight, module.bias)

    def sparse_linear(self, module, threshold):
        """F32 / F16 / BF16 weights and the block formats of SPARSE_BLOCK_QTYPES: the columns of masked
        activations skipped (sparse_linear.py's SparseColumnsLinear, SparseBlocksLinear); other block
        formats: the masked input through their int8 kernel (nothing skipped; SparseBlocksLinear too)."""
        ext = quant_kernels.extension()
        sparse = None if ext is None else (SparseColumnsLinear.of(module, threshold, ext)
                                           or SparseBlocksLinear.of(module, threshold, ext))
        return super().sparse_linear(module, threshold) if sparse is None else sparse

    def check_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        if kv_cache_dtype == "fp8_e4m3":
            raise ValueError("kv_cache_dtype fp8 is for the gpu backend (its Triton kernels); the cpu backend's "
                             "8-bit KV cache is q8_0 (--kv-cache-dtype q8_0: about as many tokens in a budget)")

    def rms_norm(self, x, weight, eps, weight_offset=0.0, residual=None):
        """As the reference; the sum residual + x is written into `residual`."""
        if residual is not None and not residual.is_contiguous():
            return super().rms_norm(x, weight, eps, weight_offset, residual)
        x = x.contiguous()
        target, add = (x, None) if residual is None else (residual, x)
        out = torch.empty_like(x)
        self.kernels.rms_norm(target.data_ptr(), 0 if add is None else add.data_ptr(), weight.data_ptr(),
                              out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, weight_offset,
                              torch.get_num_threads())
        return out if residual is None else (out, target)

    def rope_and_store_kv(self, q, k, v, rotary, kv_cache, slot_mapping):
        """One kernel call: k rotated straight into its cache slot, rounded or quantized there for a
        float16 or q8_0 cache (rows may be strided views of a merged projection, each token's heads
        side by side)."""
        k_cache, v_cache = kv_cache
        kv_format = whole_caches_format(k_cache, v_cache)
        if not (_heads_contiguous(q) and _heads_contiguous(k) and _heads_contiguous(v)) or kv_format is None:
            return super().rope_and_store_kv(q, k, v, rotary, kv_cache, slot_mapping)
        tokens, heads, head_dim = q.shape
        q_out = torch.empty(tokens, heads, head_dim)
        cos, sin = (t.contiguous() for t in rotary)
        (k_data, k_scales), (v_data, v_scales) = data_pointers(k_cache), data_pointers(v_cache)
        self.kernels.rope_and_store_kv(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0), cos.data_ptr(),
            sin.data_ptr(), slot_mapping.data_ptr(), q_out.data_ptr(), k_data, v_data, k_scales, v_scales, kv_format,
            tokens, heads, k.shape[1], head_dim, torch.get_num_threads(),
        )
        return q_out

    def prefill_attention(self, q, k_cache, v_cache, seq: PrefillSequence, scale: float, softcap=None, window=None,
                          sinks=None):
        heads, kv_heads = q.shape[1], k_cache.shape[1]
        if not seq.causal or heads // kv_heads > self.kernels.PREFILL_MAX_GROUP:
            return super().prefill_attention(q, k_cache, v_cache, seq, scale, softcap, window, sinks)
        keys = read_rows(k_cache, seq.context_slots, torch.float32).contiguous()  # [L, kv_heads, D]
        values = read_rows(v_cache, seq.context_slots, torch.float32).contiguous()
        q = q.contiguous()
        sinks = None if sinks is None else sinks.float().contiguous()
        out = q.new_empty(*q.shape[:-1], values.shape[-1])
        self.kernels.prefill_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                       0 if sinks is None else sinks.data_ptr(), out.data_ptr(), q.shape[0],
                                       keys.shape[0], heads, kv_heads, q.shape[2], values.shape[2], scale,
                                       softcap or 0.0, window or 0, torch.get_num_threads())
        return out

    def decode_attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                         split_len: int = DECODE_SPLIT_LEN,
                         softcap: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None):
        kv_format = whole_caches_format(k_cache, v_cache)
        if kv_format is None:
            return super().decode_attention(q, k_cache, v_cache, meta, scale, softcap=softcap, window=window,
                                            sinks=sinks)
        sinks = None if sinks is None else sinks.float().contiguous()
        q = q.contiguous()
        heads, head_dim = q.shape[1:]
        kv_heads = k_cache.shape[1]
        threads = torch.get_num_threads()
        out = torch.empty_like(q)
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        (k_data, k_scales), (v_data, v_scales) = data_pointers(k_cache), data_pointers(v_cache)
        self.kernels.decode_attention(
            q.data_ptr(), k_data, v_data, k_scales, v_scales, kv_format, tables.data_ptr(), lens.data_ptr(),
            meta.decode_query_start.data_ptr(), *tree_pointers(meta), 0 if sinks is None else sinks.data_ptr(),
            out.data_ptr(), meta.num_decodes, heads, kv_heads, head_dim,
            meta.block_size, tables.shape[1], scale, softcap or 0.0, split_len, window or 0, threads,
        )
        return out

    def act_and_mul(self, gate, up, activation):
        """SiLU's through the kernel decode_layers runs (gate and up side by side in each row of
        one merged projection's output), so that a token's K/V come out the same whichever path
        computed it: speculative steps change which steps take which path."""
        inter = gate.shape[-1]
        if not (activation == "silu" and gate.dtype == torch.float32 and gate.dim() == 2
                and gate.stride() == (2 * inter, 1)
                and up.stride() == gate.stride() and up.data_ptr() == gate.data_ptr() + inter * gate.element_size()):
            return super().act_and_mul(gate, up, activation)
        out = torch.empty(gate.shape[0], inter)
        self.kernels.silu_and_mul(gate.data_ptr(), out.data_ptr(), gate.shape[0], inter, torch.get_num_threads())
        return out

    def conv1d_step(self, x, state, weight, bias, meta):
        """As the reference, each window shifted in place in its slot (cpu_kernels/state_ops.cpp)."""
        if not float32_contiguous(x, state, weight, *([] if bias is None else [bias])):
            return super().conv1d_step(x, state, weight, bias, meta)
        out = torch.empty_like(x)
        self.kernels.conv1d_step(x.data_ptr(), state.data_ptr(), meta.single_slots.data_ptr(),
                                 meta.single_fresh.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                 out.data_ptr(), x.shape[0], x.shape[1], weight.shape[1], torch.get_num_threads())
        return out

    def delta_rule_step(self, q, k, v, g, beta, state, meta):
        """As the reference, each state updated in place in its slot (cpu_kernels/state_ops.cpp)."""
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        if not float32_contiguous(q, k, v, g, beta, state) or v.shape[-1] > 1024:
            return super().delta_rule_step(q, k, v, g, beta, state, meta)
        out = torch.empty_like(v)
        self.kernels.delta_rule_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                     state.data_ptr(), meta.single_slots.data_ptr(), meta.single_fresh.data_ptr(),
                                     out.data_ptr(), v.shape[0], v.shape[1], q.shape[-1], v.shape[-1],
                                     torch.get_num_threads())
        return out

    def gated_delta_net_step(self, layer, qkv, z, b, a, state, meta):
        """cpu_kernels/state_ops.cpp's gated_delta_net_step where every row is a decode (one row per sequence)
        and the tensors are float32 with rows of contiguous values: at batch 1 the layer's ~30 torch ops
        between its projections cost more than their arithmetic. The layer's weights and shapes are bound
        once (layer.backend_state): at batch 1 reading them per call is a visible share of the kernel's time."""
        bound = layer.backend_state.get("delta_net")
        if bound is None:
            bound = layer.backend_state["delta_net"] = delta_net_weights(layer)
        conv_state, delta_state = state
        rows = qkv.shape[0]
        if (not bound or meta.single_rows.numel() != rows or not float32_contiguous(conv_state, delta_state)
                or not all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in (qkv, z, b, a))):
            return None
        out = torch.empty(rows, layer.value_heads * layer.value_dim)
        self.kernels.gated_delta_net_step(
            qkv.data_ptr(), qkv.stride(0), z.data_ptr(), z.stride(0), b.data_ptr(), b.stride(0), a.data_ptr(),
            a.stride(0), bound[0], conv_state.data_ptr(), *bound[1:6], delta_state.data_ptr(),
            meta.single_slots.data_ptr(), meta.single_fresh.data_ptr(), out.data_ptr(), rows, *bound[6:],
            torch.get_num_threads())
        return out

    def ssm_step(self, q, k, v, g, state, meta):
        """As the reference, each state updated in place in its slot (cpu_kernels/state_ops.cpp)."""
        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
        if not float32_contiguous(q, k, v, g, state):
            return super().ssm_step(q, k, v, g, state, meta)
        out = torch.empty_like(v)
        self.kernels.ssm_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), state.data_ptr(),
                              meta.single_slots.data_ptr(), meta.single_fresh.data_ptr(), out.data_ptr(), v.shape[0],
                              v.shape[1], q.shape[-1], v.shape[-1], torch.get_num_threads())
        return out

    def decode_and_sample(self, model, step, kv_caches, sampling):
        """The forward pass, LM head and draws of a decode step, the draws by the step's head
        (engine/step_sampling.py) rather than the runner's general sampler: a small model's decode
        step is ~8 ms, and building and running the sampler's batch for it is ~0.5 ms of that. Where
        every row is greedy and the model is on the decode path, all of it in one kernel call."""
        if sampling.all_greedy and (drawn := self._greedy_step(model, step, kv_caches)) is not None:
            return drawn
        logits = model.compute_logits(self.forward(model, step, kv_caches))
        return sampling.head(logits, torch.from_numpy(sampling.params))

    def _greedy_step(self, model, step, kv_caches) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A greedy decode step as one of greedy_passes' passes: the embedding, the layers, the final norm,
        the LM head and each row's argmax and log-probability, the same kernels in the same order as the
        modules' path (the same tokens and log-probabilities, bit for bit) with none of its Python between
        them (~0.5 ms of a 4-layer TinyLlama's 7 ms step at batch 1). None where the kernel does not run the
        step (then the modules do)."""
        logprobs = torch.empty(step.num_seqs)  # (made before the call: a torch op after it runs with cold caches)
        choices = self.greedy_passes(model, step, None, [], kv_caches, logprobs)
        return None if choices is None else (choices, logprobs)

    def argmax_and_logsumexp(self, logits):
        """As the reference, both in one kernel call (a row's second pass reads it from the caches)."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1 or not logits.shape[1]:
            return super().argmax_and_logsumexp(logits)
        ids, lse = torch.empty(logits.shape[0], dtype=torch.int64), torch.empty(logits.shape[0])
        self.kernels.argmax_and_logsumexp(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                                          ids.data_ptr(), lse.data_ptr(), torch.get_num_threads())
        return ids, lse

    def apply_token_bitmask(self, logits, rows, bitmask):
        """As the reference, the copy and the masks in one pass, into a buffer this backend keeps:
        the result holds until the next call (the sampler uses it within its own call only)."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            return super().apply_token_bitmask(logits, rows, bitmask)
        if self._masked_logits.numel() < logits.numel():
            self._masked_logits = torch.empty(logits.numel())
        out = self._masked_logits[: logits.numel()].view(logits.shape)
        rows, bitmask = rows.contiguous(), bitmask.contiguous()
        self.kernels.mask_tokens(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.stride(0), rows.data_ptr(),
                                 len(rows), bitmask.data_ptr(), bitmask.shape[1], logits.shape[1],
                                 torch.get_num_threads())
        return out

    def run_experts(self, moe, x, counts):
        """All chosen experts' gate/up projections in one kernel call and their down projections in
        another, where every expert's weights are on the int8 kernel (hearth/backend/cpu_experts.py)."""
        state = moe.backend_state  # emptied when the layer's tensors move (their pointers change)
        if "grouped" not in state:
            state["grouped"] = GroupedExperts.bind(moe.experts)
        grouped = state["grouped"]
        if grouped is None or x.dtype != torch.float32 or not x.is_cpu:
            return None
        return grouped(x, counts)

    def decode_layers(self, model, x, rotary, kv_caches, meta, exits=None):
        if meta.prefills:
            return None
        path = self._decode_path(model)
        return None if path is None else path(x, rotary, kv_caches, meta, exits)

    def greedy_passes(self, model, first, later, feeds, kv_caches, logprobs: torch.Tensor | None = None
                      ) -> torch.Tensor | None:
        """Chained greedy passes in one call (a draft model's, hearth/engine/draft_runner.py; the target's
        multi-step decoding, hearth/engine/speculation/multi_step.py; a plain greedy decode step, one pass): the first
        pass's sequences, then each later pass's rows (a row a sequence, laid out end to end in `later`),
        row i of pass 1 + p fed the token chosen at row feeds[p][i] of the pass before; every choice the
        argmax of the logits of a sequence's last row. Returns the passes' choices end to end (int64 [their
        sequences]), their log-probabilities written to `logprobs` where given; None where the kernel does
        not run the model (layers off the decode path, states, a norm with an offset, logits divided: then
        the runner runs the passes one by one)."""
        path = self.greedy_path(model)
        return None if path is None else path.greedy_passes(first, later, feeds, model.rope, kv_caches, logprobs)

    def greedy_path(self, model):
        """The model's CpuDecodePath where greedy_passes can run it, else None."""
        path = self._decode_path(model)
        if (path is None or path.vocabulary is None or path.state_layers or path.norm_offset
                or model.config.logits_divisor != 1.0):
            return None
        return path

    def _decode_path(self, model):
        """The model's CpuDecodePath, or None where its layers do not fit it."""
        state = model.backend_state  # emptied when the model's tensors move (their pointers change)
        if "decode_path" not in state:
            state["decode_path"] = CpuDecodePath.for_model(model, self.kernels)
        return state["decode_path"]


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[T, heads, head_dim] with each token's heads side by side (tokens may be strided)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]
