"""A multi-turn batch on the wire (actor process -> learner process, and a checkpoint's pending
buffer): the loss mask that keeps the environment's tokens out of the loss, per-turn advantages,
samples with turns and the actor's episodic memory arrive as they were sent, with no pickle (a
JSON header and int64/float32 tensors)."""

from __future__ import annotations

import json

import torch

from rollout.runtime.online.batches import (
    RolloutBatch,
    Sample,
    concat,
    from_wire,
    pad_for_learner,
    to_wire,
)
from rollout.runtime.online.pending import PendingBatches, read_share, write_shares

MEMORY = {"format_version": 1, "max_entries": 1000, "agents": {"a": [{"text": "t", "step": 2}]}}


def _episodes() -> RolloutBatch:
    # Episode 0: answer [5, 6], the environment's [7, 8], answer [9]; episode 1: one answer.
    return RolloutBatch(
        prompt_ids=[[1, 2], [1, 2]],
        completion_ids=[[5, 6, 7, 8, 9], [5, 4]],
        old_logprobs=[[-0.5, -1.0, 0.0, 0.0, -0.25], [-0.5, -2.0]],
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.5, -0.5]),
        group_size=2,
        policy_version=4,
        texts=["9", "4"],
        token_advantages=[[0.75, 0.75, 0.0, 0.0, 0.25], [-0.5, -0.5]],
        loss_mask=[[1, 1, 0, 0, 1], [1, 1]],
        samples=[
            Sample(
                "Guess my number",
                None,
                [
                    {"role": "assistant", "content": "5"},
                    {"role": "user", "content": "higher"},
                    {"role": "assistant", "content": "9"},
                ],
                1.0,
                {"turn_rewards": [0.0, 1.0], "solved": True, "failure": None},
            )
        ],
        actor_memory=MEMORY,
    )


def _through_json(header: dict) -> dict:
    return json.loads(json.dumps(header))  # what crosses is UTF-8 JSON


def test_a_multi_turn_batch_survives_the_wire() -> None:
    sent = _episodes()
    header, tensors = to_wire(sent)
    assert {t.dtype for t in tensors} <= {torch.int64, torch.float32}
    got = from_wire(_through_json(header), tensors)
    for name in ("prompt_ids", "completion_ids", "old_logprobs", "texts", "loss_mask"):
        assert getattr(got, name) == getattr(sent, name), name
    assert got.token_advantages == sent.token_advantages
    assert torch.equal(got.rewards, sent.rewards) and torch.equal(got.advantages, sent.advantages)
    assert got.samples == sent.samples and got.samples[0].turns[1]["content"] == "higher"
    assert got.actor_memory == MEMORY
    # The learner trains on the model's tokens only: the environment's are out of the loss.
    padded = pad_for_learner(got, pad_id=0, device="cpu")
    assert padded.completion_mask.tolist() == [
        [True, True, False, False, True],
        [False, False, False, True, True],
    ]
    assert got.num_completion_tokens == 5


def test_per_turn_rewards_cross_for_the_kinds_that_score_per_token() -> None:
    sent = _episodes()
    sent.token_advantages = None  # PPO, REINFORCE++: the learner scores the turns' rewards
    sent.token_rewards = [[0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.25]]
    got = from_wire(_through_json(to_wire(sent)[0]), to_wire(sent)[1])
    assert got.token_rewards == sent.token_rewards and got.token_advantages is None
    assert got.loss_mask == sent.loss_mask


def test_a_batch_without_episode_rows_sends_no_mask_and_reads_as_before() -> None:
    plain = _episodes()
    plain.loss_mask = plain.token_advantages = plain.actor_memory = None
    header, tensors = to_wire(plain)
    assert len(tensors) == 5 and not header["loss_mask"] and "actor_memory" not in header
    old_header = {k: v for k, v in header.items() if k not in ("loss_mask", "token_advantages")}
    got = from_wire(old_header, tensors)  # a buffer saved before the flags existed
    assert got.loss_mask is None and got.token_advantages is None and got.actor_memory is None


def test_shares_concatenate_filling_a_mask_where_a_share_had_only_answers() -> None:
    masked = _episodes()
    answers = _episodes().select([1])  # select leaves samples and memory behind
    answers.loss_mask = None
    assert answers.samples == [] and answers.actor_memory is None
    joined = concat([from_wire(*to_wire(masked)), from_wire(*to_wire(answers))])
    assert joined.loss_mask == [[1, 1, 0, 0, 1], [1, 1], [1, 1]]
    assert joined.token_advantages == [*masked.token_advantages, [-0.5, -0.5]]
    assert joined.actor_memory == MEMORY and len(joined.samples) == 1


def test_a_pending_multi_turn_batch_is_checkpointed_and_read_back(tmp_path) -> None:
    pending = PendingBatches()
    pending.put(3, _episodes(), {"episode/turns_mean": 1.5})
    write_shares(tmp_path, [pending.share()])
    (entry,) = read_share(tmp_path, 0)
    got = from_wire(entry["header"], entry["tensors"])
    assert entry["step"] == 3 and entry["metrics"] == {"episode/turns_mean": 1.5}
    assert got.loss_mask == _episodes().loss_mask
    assert got.token_advantages == _episodes().token_advantages
