"""Where activation sparsity applies in the decoder, and the transform that applies it (docs/sparsity.md).

TEAL (Liu et al. 2024) zeroes the low-magnitude entries of every hidden state that enters a
weight matrix, with one threshold per state per layer, calibrated offline so that a target share
of the entries falls under it; CATS (Lee et al. 2024) did the same for the MLP's gated
intermediate. A layer has four such inputs ("sites"), named by the projection that reads them:

    qkv_proj      the normed hidden state q, k and v read (one input, one threshold)
    o_proj        attention's output
    gate_up_proj  the normed hidden state gate and up read
    down_proj     the gated intermediate act(gate) * up

The transform replaces each projection reading a site by its backend's `sparse_linear` (the
backend decides whether it can skip the masked columns' weights); the lm_head stays dense.
Dense attention + gated-MLP layers only: experts, latent attention and state layers are refused.
"""

from __future__ import annotations

from torch import nn

from hearth.errors import HearthError
from hearth.model.attention import Attention
from hearth.model.layers import GatedMLP, MergedLinear
from hearth.model.transformer import Transformer

SITES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def site_modules(model: Transformer) -> dict[tuple[int, str], nn.Module]:
    """(layer index, site) -> the module that reads that input: a MergedLinear for qkv_proj and
    gate_up_proj, the projection itself for o_proj and down_proj. HearthError for layers it does not cover."""
    found = {}
    for index, layer in enumerate(model.layers):
        attention, mlp = getattr(layer, layer.mixer_name), layer.mlp
        if type(attention) is not Attention or type(mlp) is not GatedMLP:
            raise HearthError(f"activation sparsity covers attention + gated-MLP layers; layer {index} of this "
                              f"{model.config.architecture} model has {type(attention).__name__} and "
                              f"{type(mlp).__name__}")
        for site, module in zip(SITES, (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            found[(index, site)] = module
    return found


def apply_activation_sparsity(model: Transformer, thresholds: dict[tuple[int, str], float]) -> None:
    """Every site's projections replaced by the model's backend's sparse_linear with its threshold."""
    ops = model.backend
    for (index, site), module in site_modules(model).items():
        threshold = thresholds[(index, site)]
        if isinstance(module, MergedLinear):
            module.parts = nn.ModuleList(ops.sparse_linear(part, threshold) for part in module.parts)
        else:
            parent = getattr(model.layers[index], "self_attn" if site == "o_proj" else "mlp")
            setattr(parent, site, ops.sparse_linear(module, threshold))
