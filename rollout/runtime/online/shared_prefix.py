"""Completion log-probs with each distinct prompt run once: the learner's forward for GRPO-shaped
micro batches, where the n completions of a prompt share it.

The plain forward (pad_for_learner) runs prompt + completion for every row, so a prompt sampled
n times is run n times, forward and backward. Here the distinct prompts run once, their keys and
values are repeated across the rows that share them, and the completions run on top of that
cache. Autograd sums the repeated rows' gradients back into the one prompt pass, so loss and
gradients are those of the plain forward (up to float rounding); the work saved is
(n - 1) / n of the prompt tokens. With a 45-token prompt, 4 completions of about 24 tokens, that is
about half the learner's tokens.

Layout of the result: [B, K] in PaddedBatch's layout (each row's completion ends at column K - 1),
so the loss code does not know which forward ran.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from rollout.runtime.logprobs import final_states, token_scores
from rollout.runtime.online.batches import RolloutBatch
from rollout.runtime.sharding import is_sharded


def shares_prompts(batch: RolloutBatch) -> bool:
    """Whether some rows repeat a prompt (only then does the shared-prefix forward save work)."""
    return len({tuple(p) for p in batch.prompt_ids}) < len(batch.prompt_ids)


def supports_shared_prefix(model: torch.nn.Module) -> bool:
    """A transformers causal LM that can take a key/value cache in a training forward:
    gradient checkpointing turns the cache off, so such a model takes the plain forward. So does
    a sharded one: whether a micro batch shares its prompts differs between learners, and each
    learner must run the same forwards (each gathers the layers from every learner)."""
    if is_sharded(model):
        return False
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # new name first
        if hasattr(type(model), name):
            return not getattr(model, name)
    return True


def shared_prefix_logprobs(
    model: torch.nn.Module,
    batch: RolloutBatch,
    *,
    pad_token_id: int,
    device: torch.device | str,
    temperature: float,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) of each completion token: [B, K] float32, K the longest
    completion, left-padded as in PaddedBatch (zeros where a row has no token). With
    `entropy`, also the policy's entropy at each of those positions ([B, K], no gradient), else
    None."""
    distinct: dict[tuple[int, ...], int] = {}
    row_prompt = [distinct.setdefault(tuple(p), len(distinct)) for p in batch.prompt_ids]
    prompts = [list(p) for p in distinct]

    # The distinct prompts, left-padded so that each ends at the last column.
    width = max(len(p) for p in prompts)
    prompt_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device="cpu")
    prompt_mask = torch.zeros((len(prompts), width), dtype=torch.long, device="cpu")
    for i, prompt in enumerate(prompts):
        prompt_ids[i, width - len(prompt) :] = torch.tensor(prompt, device="cpu")
        prompt_mask[i, width - len(prompt) :] = 1
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)

    cache = DynamicCache(config=model.config)
    # The last prompt position predicts each completion's first token.
    prompt_states = final_states(
        model,
        keep=1,
        input_ids=prompt_ids.to(device),
        attention_mask=prompt_mask.to(device),
        position_ids=prompt_positions.to(device),
        cache=cache,
        use_cache=True,
    )
    # Host and device copies of the row -> prompt map: the host one indexes host tensors, so
    # nothing here waits for the device.
    host_rows = torch.tensor(row_prompt, device="cpu")
    rows = host_rows.to(device)
    cache.batch_select_indices(rows)  # differentiable indexing: gradients sum over repeats

    # The completions, right-padded after their prompt: padding at the end of a row is never
    # attended to by the row's real tokens.
    lengths = [len(c) for c in batch.completion_ids]
    longest = max(1, max(lengths))
    completion_ids = torch.full((len(batch), longest), pad_token_id, dtype=torch.long, device="cpu")
    completion_mask = torch.zeros((len(batch), longest), dtype=torch.long, device="cpu")
    for i, completion in enumerate(batch.completion_ids):
        completion_ids[i, : len(completion)] = torch.tensor(
            completion, dtype=torch.long, device="cpu"
        )
        completion_mask[i, : len(completion)] = 1
    prompt_lengths = prompt_mask.sum(-1)[host_rows]
    positions = prompt_lengths[:, None] + torch.arange(longest, device="cpu")[None, :]
    mask = torch.cat([prompt_mask[host_rows], completion_mask], dim=1)
    completion_states = final_states(
        model,
        keep=longest,
        input_ids=completion_ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        cache=cache,
        use_cache=True,
    )
    # Token k of a completion is predicted by the state before it: the prompt's last position
    # for k = 0, the completion's position k - 1 after that.
    states = torch.cat([prompt_states[rows], completion_states[:, : longest - 1]], dim=1)
    right, entropies = token_scores(  # [B, K], each row's tokens from column 0
        model,
        states,
        completion_ids.to(device),
        completion_mask.flatten().nonzero().squeeze(1),
        temperature=temperature,
        entropy=entropy,
    )
    mask = _right_mask(lengths, longest, right.device)
    logprobs = _align_right(right, lengths) * mask
    if entropies is None:
        return logprobs, None
    return logprobs, _align_right(entropies, lengths) * mask


def _align_right(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Move each row's first lengths[i] values to the end of the row (differentiable)."""
    longest = values.shape[1]
    shift = torch.tensor([longest - n for n in lengths], device=values.device)
    source = (torch.arange(longest, device=values.device)[None, :] - shift[:, None]).clamp(min=0)
    return values.gather(1, source)


def _right_mask(lengths: list[int], longest: int, device: torch.device) -> torch.Tensor:
    """[B, longest] float: 1 in each row's last lengths[i] columns."""
    columns = torch.arange(longest, device=device)[None, :]
    firsts = torch.tensor([longest - n for n in lengths], device=device)
    return (columns >= firsts[:, None]).float()
