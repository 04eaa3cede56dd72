"""The rollout batch: what the actor hands the learner, typed, with the policy version that made it.

Sequences are kept ragged (lists of token ids) until the learner pads one micro batch at a time,
so a batch is cheap to build, slice and (later) send between processes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Sample:
    """One completion (or multi-turn episode) of a rollout as text, for the run store's samples
    (logging.samples_per_step): the strings exist already, so building one costs no decode."""

    prompt: str
    completion: str | None
    """None for an environment episode: see `turns`; an agent episode's final answer."""
    turns: list[dict[str, Any]] | None
    """A multi-turn episode's messages after the prompt: [{"role", "content"}, ...] (an agent
    episode's also carry metadata: storage.base.SampleRecord.turns)."""
    reward: float
    extra: dict[str, Any]


@dataclass
class RolloutBatch:
    """B completions; completions of one prompt are contiguous (groups of ``group_size``)."""

    prompt_ids: list[list[int]]
    """[B][prompt_len_i]: each completion's prompt (repeated across its group)."""
    completion_ids: list[list[int]]
    """[B][completion_len_i]: sampled tokens, EOS included when the model stopped."""
    old_logprobs: list[list[float]]
    """[B][completion_len_i]: log-probs the sampling policy gave each sampled token."""
    rewards: torch.Tensor
    """[B] float32: weighted sum of the reward functions."""
    advantages: torch.Tensor
    """[B] float32: one advantage per completion, broadcast over its tokens."""
    group_size: int
    policy_version: int
    texts: list[str] = field(default_factory=list)
    """[B]: decoded completions (for logs and rewards; the learner trains on the ids)."""
    token_advantages: list[list[float]] | None = None
    """[B][completion_len_i]: per-token advantages (PPO, REINFORCE++); when set, the learner
    uses them instead of ``advantages``."""
    old_values: list[list[float]] | None = None
    """[B][completion_len_i]: the critic's values when the batch was scored (PPO)."""
    returns: list[list[float]] | None = None
    """[B][completion_len_i]: the critic's targets (PPO)."""
    loss_mask: list[list[int]] | None = None
    """[B][completion_len_i]: 1 where the model wrote the token (it is trained on), 0 where the
    environment did (a multi-turn episode's messages: context only); None: every completion
    token is the model's."""
    token_rewards: list[list[float]] | None = None
    """[B][completion_len_i]: a multi-turn episode's per-turn rewards, each on its answer's last
    token (environment.advantage = "turn"), for the kinds that score per token; None: `rewards`
    on each row's last policy token."""
    samples: list[Sample] = field(default_factory=list)
    """A few completions as text, carried from an actor process to the learner that records
    them (logging.samples_per_step); not row-aligned: `select` leaves them behind."""
    actor_memory: dict[str, Any] | None = None
    """The actor's episodic memory (rollout.harness.memory, its JSON) as it was after sampling
    this batch, carried to the learners that checkpoint it (a split placement: the memory lives
    in the actor's process); not row-aligned: `select` leaves it behind."""

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def num_completion_tokens(self) -> int:
        """Tokens the loss is over: the model's own (an environment's are not trained on)."""
        if self.loss_mask is not None:
            return sum(sum(row) for row in self.loss_mask)
        return sum(len(c) for c in self.completion_ids)

    def select(self, indices: list[int]) -> RolloutBatch:
        """The sub-batch at ``indices`` (for minibatches and micro batches)."""
        return RolloutBatch(
            prompt_ids=[self.prompt_ids[i] for i in indices],
            completion_ids=[self.completion_ids[i] for i in indices],
            old_logprobs=[self.old_logprobs[i] for i in indices],
            rewards=self.rewards[indices],
            advantages=self.advantages[indices],
            group_size=self.group_size,
            policy_version=self.policy_version,
            texts=[self.texts[i] for i in indices] if self.texts else [],
            token_advantages=_pick(self.token_advantages, indices),
            old_values=_pick(self.old_values, indices),
            returns=_pick(self.returns, indices),
            loss_mask=_pick(self.loss_mask, indices),
            token_rewards=_pick(self.token_rewards, indices),
        )


def _pick(rows: list[list[Any]] | None, indices: list[int]) -> list[list[Any]] | None:
    return None if rows is None else [rows[i] for i in indices]


@dataclass
class PaddedBatch:
    """A micro batch ready for one forward pass: prompt + completion, LEFT-padded, so every
    row's completion ends at the last position and the logits of the last ``K + 1`` positions
    (K = the longest completion) cover every completion token. The model then never computes
    vocabulary logits for prompt positions.

    Shapes: input_ids, attention_mask, position_ids [B, L]; targets, completion_mask and
    old_logprobs [B, K], where position k holds token L - K + k, predicted by logits at
    L - K - 1 + k.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    completion_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    """[B] one per sequence, or [B, K] per token when the batch has token advantages."""
    old_values: torch.Tensor | None = None
    """[B, K] (PPO)."""
    returns: torch.Tensor | None = None
    """[B, K] (PPO)."""
    completion_rows: torch.Tensor | None = None
    """[N] int64 indices of the completion tokens in the flattened [B * K] layout, on the CPU
    (where the padding made them: reading them never waits for the device)."""

    @property
    def logits_to_keep(self) -> int:
        return self.targets.shape[1] + 1


def pad_for_learner(batch: RolloutBatch, pad_id: int, device: torch.device | str) -> PaddedBatch:
    rows = [p + c for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True)]
    length = max(len(r) for r in rows)
    longest = max(1, max(len(c) for c in batch.completion_ids))
    size = len(rows)
    input_ids = torch.full((size, length), pad_id, dtype=torch.long, device="cpu")
    attention = torch.zeros((size, length), dtype=torch.long, device="cpu")
    completion = torch.zeros((size, longest), dtype=torch.bool, device="cpu")
    old = torch.zeros((size, longest), dtype=torch.float32, device="cpu")
    for i, (row, logprobs) in enumerate(zip(rows, batch.old_logprobs, strict=True)):
        input_ids[i, length - len(row) :] = torch.tensor(row, device="cpu")
        attention[i, length - len(row) :] = 1
        if logprobs:
            completion[i, longest - len(logprobs) :] = True
            old[i, longest - len(logprobs) :] = torch.tensor(
                logprobs, dtype=torch.float32, device="cpu"
            )
    # Log-probs are computed at every completion position (an environment's tokens too: the
    # model reads them), the loss only where the model wrote.
    rows_scored = completion.flatten().nonzero().squeeze(1)
    if batch.loss_mask is not None:
        completion = pad_left(batch.loss_mask, longest).bool()
    # Positions count real tokens only, as the engine's did when it sampled with left padding.
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    advantages = batch.advantages
    if batch.token_advantages is not None:
        advantages = pad_left(batch.token_advantages, longest)
    return PaddedBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        position_ids=positions.to(device),
        targets=input_ids[:, length - longest :].to(device),
        completion_mask=completion.to(device),
        old_logprobs=old.to(device),
        advantages=advantages.to(device),
        old_values=_pad_optional(batch.old_values, longest, device),
        returns=_pad_optional(batch.returns, longest, device),
        completion_rows=rows_scored,
    )


def pad_left(rows: list[list[float]], width: int) -> torch.Tensor:
    """Ragged per-token values -> [B, width] float32, each row in its last columns (0 before)."""
    padded = torch.zeros((len(rows), width), dtype=torch.float32, device="cpu")
    for i, row in enumerate(rows):
        if row:
            padded[i, width - len(row) :] = torch.tensor(row, dtype=torch.float32, device="cpu")
    return padded


def unpad_left(values: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    """[B, width] -> ragged rows: row i's last lengths[i] columns (the inverse of pad_left)."""
    width = values.shape[1]
    rows = values.detach().float().cpu().tolist()
    return [row[width - n :] if n else [] for row, n in zip(rows, lengths, strict=True)]


def _pad_optional(
    rows: list[list[float]] | None, width: int, device: torch.device | str
) -> torch.Tensor | None:
    return None if rows is None else pad_left(rows, width).to(device)


# --- on the wire (actor process -> learner process) ----------------------------------------------


PER_TOKEN = (
    ("loss_mask", torch.long),
    ("token_advantages", torch.float32),
    ("token_rewards", torch.float32),
)
"""A multi-turn batch's optional per-token rows that cross with it, in the order their tensors
follow the five every batch has (the header says which are there)."""


def to_wire(batch: RolloutBatch) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A batch as a JSON header and flat tensors (rollout.runtime.weight_sync sends them): the
    ragged rows are concatenated, their lengths in the header. A batch crosses before the learner
    scores it per token (values, returns, PPO's advantages), so it has none of those yet; a
    multi-turn episode's rows that its actor made cross with it (`PER_TOKEN`: the loss mask,
    per-turn advantages or per-turn rewards with environment.advantage = "turn")."""
    if batch.old_values is not None or batch.returns is not None:
        raise ValueError("a batch crosses to the learner before it is scored per token")
    header = {
        "group_size": batch.group_size,
        "policy_version": batch.policy_version,
        "prompt_lengths": [len(p) for p in batch.prompt_ids],
        "completion_lengths": [len(c) for c in batch.completion_ids],
        "texts": list(batch.texts),
        "samples": [asdict(sample) for sample in batch.samples],
        **{name: getattr(batch, name) is not None for name, _ in PER_TOKEN},
    }
    if batch.actor_memory is not None:
        header["actor_memory"] = batch.actor_memory
    tensors = [
        torch.tensor([t for p in batch.prompt_ids for t in p], dtype=torch.long, device="cpu"),
        torch.tensor([t for c in batch.completion_ids for t in c], dtype=torch.long, device="cpu"),
        _flat(batch.old_logprobs, torch.float32),
        batch.rewards.float().cpu(),
        batch.advantages.float().cpu(),
    ]
    for name, dtype in PER_TOKEN:
        rows = getattr(batch, name)
        if rows is not None:
            tensors.append(_flat(rows, dtype))
    return header, tensors


def from_wire(header: dict[str, Any], tensors: list[torch.Tensor]) -> RolloutBatch:
    """The inverse of `to_wire` (a header without the PER_TOKEN flags, from a buffer saved
    before they existed, has none of those rows)."""
    prompts, completions, logprobs, rewards, advantages, *optional = tensors
    completion_lengths = header["completion_lengths"]
    following = iter(optional)
    per_token = {
        name: _split(next(following).tolist(), completion_lengths)
        for name, _ in PER_TOKEN
        if header.get(name)
    }
    return RolloutBatch(
        prompt_ids=_split(prompts.tolist(), header["prompt_lengths"]),
        completion_ids=_split(completions.tolist(), completion_lengths),
        old_logprobs=_split(logprobs.tolist(), completion_lengths),
        rewards=rewards,
        advantages=advantages,
        group_size=header["group_size"],
        policy_version=header["policy_version"],
        texts=header["texts"],
        samples=[Sample(**sample) for sample in header.get("samples", [])],
        actor_memory=header.get("actor_memory"),
        **per_token,
    )


def concat(parts: list[RolloutBatch]) -> RolloutBatch:
    """Batches one after another (shares of one step, from several actors). A multi-turn part
    without environment tokens has no loss mask (every token is the model's): beside parts
    that have one, its mask is all ones. The actor memory is the first part's that has one."""
    first = parts[0]
    if any(part.old_values is not None or part.returns is not None for part in parts):
        raise ValueError("a batch crosses to the learner before it is scored per token")
    memories = [part.actor_memory for part in parts if part.actor_memory is not None]
    return RolloutBatch(
        prompt_ids=[row for part in parts for row in part.prompt_ids],
        completion_ids=[row for part in parts for row in part.completion_ids],
        old_logprobs=[row for part in parts for row in part.old_logprobs],
        rewards=torch.cat([part.rewards for part in parts]),
        advantages=torch.cat([part.advantages for part in parts]),
        group_size=first.group_size,
        policy_version=min(part.policy_version for part in parts),
        texts=[text for part in parts for text in part.texts],
        token_advantages=_every_or_none(parts, "token_advantages"),
        token_rewards=_every_or_none(parts, "token_rewards"),
        loss_mask=_masks(parts),
        samples=[sample for part in parts for sample in part.samples],
        actor_memory=memories[0] if memories else None,
    )


def _masks(parts: list[RolloutBatch]) -> list[list[int]] | None:
    """The parts' loss masks one after another; a part without one (its episodes were single
    answers: every token the model's) gives all ones; None when no part has one."""
    if all(part.loss_mask is None for part in parts):
        return None
    rows = []
    for part in parts:
        rows += part.loss_mask or [[1] * len(c) for c in part.completion_ids]
    return rows


def _every_or_none(parts: list[RolloutBatch], name: str) -> list[list[float]] | None:
    """The parts' per-turn rows of `name` one after another (every actor of a run makes them,
    or none does)."""
    present = [getattr(part, name) is not None for part in parts]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"some shares of the step have {name}, some not")
    return [row for part in parts for row in getattr(part, name)]


def _flat(rows: list[list[Any]], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row], dtype=dtype, device="cpu")


def _split(flat: list, lengths: list[int]) -> list[list]:
    rows, start = [], 0
    for n in lengths:
        rows.append(flat[start : start + n])
        start += n
    return rows
