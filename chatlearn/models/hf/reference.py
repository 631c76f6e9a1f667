"""Reference model: frozen log-probs of the sampled responses, the anchor of the KL penalty."""

import torch

from chatlearn.models.hf.common import HFModule, ensure_model_files, load_causal_lm, response_logprobs


class ReferenceModel(HFModule):
    supports_pipeline = True
    supports_packing = True

    def setup(self) -> None:
        ensure_model_files(self.args)
        self.model = load_causal_lm(self.args.model_path, self.args.dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self.parallelize()

    @torch.no_grad()
    def forward_step(self, data, iteration):
        lp = response_logprobs(self.infer_model, data, self.device, self.args.temperature, packed=self.packing,
                               budget=self.packing_budget)
        return {"ref_logprobs": lp.cpu()}
