// The Python module (hearth/backend/cpu.py checks the tensors and passes data pointers).
#include <pybind11/pybind11.h>

#include "cpu_kernels.h"

using namespace hearth;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("decode_attention", &decode_attention,
        "paged attention of a few query rows per sequence, split-KV, float32, float16 or q8_0 K/V", nogil);
  m.def("prefill_attention", &prefill_attention,
        "causal attention of a prompt's rows over its gathered context, float32", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (after an optional in-place add), float32", nogil);
  m.def("rope_and_store_kv", &rope_and_store_kv, "RoPE on q and k, k and v into their cache slots, float32, float16 or q8_0", nogil);
  m.def("argmax_and_logsumexp", &argmax_and_logsumexp, "each row's argmax and log-sum-exp, float32", nogil);
  m.def("mask_tokens", &mask_tokens, "float32 logits copied, grammar bitmasks applied to the given rows", nogil);
  m.def("silu_and_mul", [](uintptr_t gate_up, uintptr_t out, int64_t tokens, int64_t inter, int threads) {
    silu_and_mul(reinterpret_cast<const float*>(gate_up), reinterpret_cast<float*>(out), tokens, inter, threads);
  }, "silu(gate) * up of each row of [gate | up], float32", nogil);
  m.def("decode_layers", &decode_layers, "a decode step through every layer, float32, int8_matmul weights", nogil);
  m.def("greedy_passes", &greedy_passes, "a draft model's greedy passes: layers, norm, lm_head, argmax, next embeddings",
        nogil);
  m.def("conv1d_step", &conv1d_step, "a causal depthwise convolution's decode step, its windows in place, float32",
        nogil);
  m.def("delta_rule_step", &delta_rule_step, "the gated delta rule's decode step, its states in place, float32", nogil);
  m.def("gated_delta_net_step", &gated_delta_net_step,
        "a Gated DeltaNet layer's decode step between in_proj and out_proj, its states in place, float32", nogil);
  m.def("ssm_step", &ssm_step, "Mamba2's selective scan's decode step, its states in place, float32", nogil);
  m.attr("KV_FORMATS") = pybind11::make_tuple("float32", "q8_0", "float16");  // by KVFormat
  m.attr("PREFILL_MAX_GROUP") = (int)PREFILL_MAX_GROUP;
  m.attr("LAYER_FIELDS") = (int)LAYER_FIELDS;
  m.attr("PASS_FIELDS") = (int)PASS_FIELDS;
  m.attr("MIXER_FIELDS") = (int)MIXER_FIELDS;
  m.attr("LORA_FIELDS") = (int)LORA_FIELDS;
  m.attr("MAX_LORA_PARTS") = (int)MAX_LORA_PARTS;
  m.attr("LORA_FORMATS") = pybind11::make_tuple("float32", "bfloat16");  // by LoraFormat
  m.attr("PROJECTION_PARTS") = pybind11::make_tuple(PARTS[QKV], PARTS[O], PARTS[GATE_UP], PARTS[DOWN]);
}
