"""
Our GPT (model.py) as a Hugging Face model: the modelling code of the folders that `python -m tools.export` writes
for models that no GPT-NeoX folder can hold (pre-projection, the content skip, the capacity adapter).

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("out/run-hf", trust_remote_code=True)

The export copies this file into the folder as modeling_preproj.py and model.py beside it as preproj_model.py,
changing only the import below, so the folder runs exactly this project's model.py. The weights are our own
parameter names under `gpt.`; config.json's `gpt` entry is our GPTConfig.
"""

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from model import GPT, GPTConfig  # the exported copy: from .preproj_model import GPT, GPTConfig


class PreprojConfig(PretrainedConfig):
    model_type = "preproj_gpt_neox"

    def __init__(self, gpt: dict | None = None, **kwargs):
        self.gpt = dict(gpt or {})
        super().__init__(**kwargs)


class PreprojForCausalLM(PreTrainedModel, GenerationMixin):
    """GPT-NeoX with this project's switches, under transformers' causal-LM interface: logits for every position,
    the shifted cross-entropy when labels are given, greedy or sampled generation (without a K/V cache)."""

    config_class = PreprojConfig
    base_model_prefix = "gpt"

    def __init__(self, config: PreprojConfig):
        super().__init__(config)
        self.gpt = GPT(GPTConfig(**config.gpt))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: every weight comes from the folder's model.safetensors."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutput:
        if attention_mask is not None and bool((attention_mask.cummin(dim=-1).values != attention_mask).any()):
            raise ValueError("left padding is not supported: pad on the right (causal attention then leaves the "
                             "real tokens' logits unchanged)")
        logits, _ = self.gpt(input_ids)
        loss = None
        if labels is not None:  # transformers' convention: position t predicts labels[t + 1]
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs) -> dict:
        """The whole sequence at every step: this wrapper keeps no cache between calls."""
        return {"input_ids": input_ids, "attention_mask": kwargs.get("attention_mask")}
