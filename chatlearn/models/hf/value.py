"""Value model: a causal-LM backbone with a scalar head, one value per response token."""

import torch
from pydantic import Field
from transformers import AutoModel

from chatlearn.models.hf.common import (
    HFModelArgs,
    HFModule,
    ensure_model_files,
    packed_hidden_states,
    response_hidden_states,
)
from chatlearn.models.hf.packing import row_chunks, rows


class ValueArgs(HFModelArgs):
    head_seed: int = Field(0, description="seed of the value head init (same for value and ppo_value)")


class ValueNetwork(torch.nn.Module):
    """Backbone (the base model of a causal LM, no LM head) + linear value head."""

    def __init__(self, model_path: str, dtype: str, head_seed: int):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(model_path, dtype=getattr(torch, dtype))
        gen = torch.Generator().manual_seed(head_seed)
        hidden = self.backbone.config.hidden_size
        self.value_head = torch.nn.Linear(hidden, 1)
        with torch.no_grad():
            self.value_head.weight.copy_(torch.randn(1, hidden, generator=gen) / hidden**0.5 * 0.1)
            self.value_head.bias.zero_()

    def forward(self, batch: dict, device: torch.device, packed: bool = False) -> torch.Tensor:
        """Values [B, R] of the positions that emit each response token (0 at padding); ``packed``: one
        forward over the sequences packed into a row, the head on the real response positions only."""
        if packed:
            hidden, p = packed_hidden_states(self.backbone, batch, device)
            return p.unpack(self.value_head(hidden.float()).squeeze(-1))[0]
        hidden = response_hidden_states(self.backbone, batch, device)
        return self.value_head(hidden.float()).squeeze(-1) * batch["response_mask"].to(device)


class ValueModel(HFModule):
    """Inference copy of the value network (weights synced from `ppo_value`)."""

    args_schema = ValueArgs
    supports_packing = True

    def setup(self) -> None:
        ensure_model_files(self.args)
        self.model = ValueNetwork(self.args.model_path, self.args.dtype, self.args.head_seed).to(self.device).eval()
        self.parallelize()

    @torch.no_grad()
    def forward_step(self, data, iteration):
        if not self.packing:
            return {"values": self.model(data, self.device).cpu()}
        return {"values": torch.cat([self.model(rows(data, c), self.device, packed=True).cpu()
                                     for c in row_chunks(data, self.packing_budget)])}
