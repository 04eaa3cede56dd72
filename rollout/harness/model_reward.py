"""A reward model trained by rollout (algorithm.kind = "rm") as a reward function.

    rewards = [{ model = "runs/RUN_ID/checkpoints/last" }]

`ModelReward` loads the saved sequence classifier and its tokenizer once, and scores batches of
(prompt, completion) as the reward model was trained to: the prompt formatted by the training
run's settings (chat template, system prompt, saved in the model's config.json), the completion
followed by the end-of-turn token, and the score read by the head at that last token.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

SAMPLE_FORMAT_KEY = "rollout_sample_format"
"""config.json entry where reward-model training records how it formatted samples."""


def reward_scores(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """[B] float32 scores of LEFT-padded rows [B, L]: the score head on each row's last token.

    The head is read at the last position rather than where transformers' own pooling looks (the
    last token that is not the pad token), which for models whose pad token is their end-of-turn
    token would be the token before it.
    """
    body = getattr(model, model.base_model_prefix)
    hidden = body(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).last_hidden_state[:, -1]
    return model.score(hidden).squeeze(-1).float()


class ModelReward:
    """fn(prompts, completions, **fields) -> one score per completion, from a saved reward model."""

    def __init__(self, directory: str | Path, *, device: str = "cpu", batch_size: int = 16):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from rollout.models.samples import HfTextTokenizer, SampleRules

        self.directory = Path(directory)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.directory, use_safetensors=True
        )
        self.model.to(self.device).eval().requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(self.directory)
        sample_format = getattr(self.model.config, SAMPLE_FORMAT_KEY, None) or {}
        eos = sample_format.get("eos_token_id", tokenizer.eos_token_id)
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = eos
        self.rules = SampleRules(
            tokenizer=HfTextTokenizer(tokenizer, tokenizer.chat_template, eos),
            fields={"prompt": "prompt", "completion": "completion"},
            use_chat_template=sample_format.get("use_chat_template", True),
            system_prompt=sample_format.get("system_prompt"),
        )
        self._lock = threading.Lock()  # one model: calls from several threads take turns
        self.__name__ = "reward_model"

    def __call__(self, prompts: list[Any], completions: list[str], **_fields: Any) -> list[float]:
        from rollout.models.batches import pad_completions

        scores: list[float] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(completions), self.batch_size):
                records = [
                    {"prompt": p, "completion": c}
                    for p, c in zip(
                        prompts[start : start + self.batch_size],
                        completions[start : start + self.batch_size],
                        strict=True,
                    )
                ]
                batch = pad_completions(
                    [self.rules.prompt(r) for r in records],
                    [self.rules.completion(r, "completion") for r in records],
                    self.pad_id,
                    self.device,
                )
                scores += reward_scores(
                    self.model, batch.input_ids, batch.attention_mask, batch.position_ids
                ).tolist()
        return scores
