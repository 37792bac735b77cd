"""A mixture of experts' shared expert (Qwen2-MoE): a dense SwiGLU MLP that every token runs
beside the experts routed to it, its output scaled by a sigmoid gate of the token
(`shared_expert_gate`, one row) and added to theirs.

The gate scales the expert's output row by row, so it is applied to the activations before
the down projection (down(g * a) = g * down(a)), and the down projection adds the residual in
its epilogue: the routed experts (model/moe.py) then add onto that, as onto any residual. The
fused C++ layer does the same (layer.cpp `run_layer`: the shared expert is the layer's
gate_up and down segments, its gate a row `decoder_stack` takes), so this module is the
reference it is checked against and the compiled road.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model.config import ModelConfig
from iterserve.model.linear import Backend, Linear, WeightMode, WeightPart

# Its checkpoint names under model.layers.N (Qwen2-MoE's; model/gguf_loader.py maps
# llama.cpp's ffn_*_shexp and ffn_gate_inp_shexp to them).
GATE_UP = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")
DOWN = "mlp.shared_expert.down_proj.weight"
GATE = "mlp.shared_expert_gate.weight"


class SharedExpert(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.hidden = config.hidden_size
        self.intermediate = config.shared_expert_intermediate_size
        self.dtype = dtype
        self.gate_weight = (
            nn.Parameter(torch.empty(1, self.hidden, dtype=dtype, device=device), False)
            if config.traits.shared_expert_gate
            else None
        )
        self.gate_up: Linear | None = None
        self.down: Linear | None = None

    def targets(self, prefix: str) -> dict[str, tuple[torch.Tensor | None, tuple[int, ...]]]:
        """HF name -> (destination of a small tensor, or None for a projection's part built by
        `build`; expected shape)."""
        hidden, inter = self.hidden, self.intermediate
        out: dict[str, tuple[torch.Tensor | None, tuple[int, ...]]] = {
            prefix + GATE_UP[0]: (None, (inter, hidden)),
            prefix + GATE_UP[1]: (None, (inter, hidden)),
            prefix + DOWN: (None, (hidden, inter)),
        }
        if self.gate_weight is not None:
            out[prefix + GATE] = (self.gate_weight, (1, hidden))
        return out

    def build(self, part: Callable[[str], WeightPart], backend: Backend, mode: WeightMode) -> None:
        """Its two Linears from their checkpoint tensors (`part(name)`, by the name under the
        layer), on the layer's kernels."""
        self.gate_up = Linear([part(name) for name in GATE_UP], None, backend, mode, self.dtype)
        self.down = Linear([part(DOWN)], None, backend, mode, self.dtype)

    def linears(self) -> list[Linear]:
        return [lin for lin in (self.gate_up, self.down) if lin is not None]

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual` + gate(x) * down(silu(gate_proj x) * up_proj x), x the normed rows."""
        assert self.gate_up is not None and self.down is not None
        gate_up = self.gate_up(x)
        act = F.silu(gate_up[:, : self.intermediate]).mul_(gate_up[:, self.intermediate :])
        if self.gate_weight is not None:  # the logit summed in fp32, then in x's dtype
            logit = F.linear(x.float(), self.gate_weight.float()).to(x.dtype)
            act = act * torch.sigmoid(logit)
        return self.down(act, residual=residual)
