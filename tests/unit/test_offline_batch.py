"""Padding and packing offline samples: layouts by hand, and packing that changes nothing about any
sample's loss (attention never crosses a sample boundary), on the tiny model."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout.algorithms.sft import IGNORE, sft_loss
from rollout.models.batches import pad_completions
from rollout.models.samples import Demonstration
from rollout.runtime.offline.batches import pack_sequences, pad_sequences
from rollout.runtime.offline.objectives import sequence_sums

PAD = 0


def demo(ids: list[int], first_target: int) -> Demonstration:
    return Demonstration(ids, [i >= first_target for i in range(len(ids))])


def test_pad_completions_left_pads_so_completions_end_together():
    batch = pad_completions([[5, 6, 7], [8]], [[9], [10, 11]], PAD, "cpu")
    assert batch.input_ids.tolist() == [[5, 6, 7, 9], [0, 8, 10, 11]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 0, 1, 2]]
    assert batch.targets.tolist() == [[7, 9], [10, 11]]
    assert batch.mask.tolist() == [[False, True], [True, True]]
    assert batch.logits_to_keep == 3 and batch.tokens == 7


def test_pad_sequences_shifts_labels_and_masks_the_prompt():
    batch = pad_sequences([demo([5, 6, 7, 8], 2), demo([9, 10], 1)], PAD, "cpu")
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert batch.labels.tolist() == [[IGNORE, 7, 8, IGNORE], [10, IGNORE, IGNORE, IGNORE]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.tokens == 6 and batch.num_targets == 3


def test_pad_sequences_without_padding_passes_no_mask():
    assert pad_sequences([demo([5, 6], 1), demo([7, 8], 1)], PAD, "cpu").attention_mask is None


def test_pack_sequences_first_fit_restarts_positions_and_labels_no_seams():
    samples = [demo([1, 2, 3], 1), demo([4, 5, 6, 7], 2), demo([8, 9], 1)]
    batch = pack_sequences(samples, 6, PAD, "cpu")
    # [1 2 3] + [8 9] fit in row 0 (the 4-token sample does not); [4 5 6 7] opens row 1. Rows
    # are as long as the longest one, not max_length.
    assert batch.input_ids.tolist() == [[1, 2, 3, 8, 9], [4, 5, 6, 7, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert batch.labels.tolist() == [[2, 3, IGNORE, 9, IGNORE], [IGNORE, 6, 7, IGNORE, IGNORE]]
    assert batch.attention_mask is None
    assert batch.row_tokens == [5, 4]
    assert batch.rows(1, 2).input_ids.tolist() == [[4, 5, 6, 7, 0]]


@pytest.fixture(scope="module")
def model(tiny_llama):
    return copy.deepcopy(tiny_llama.model).float().train()


def _loss_and_grads(model, batch, num_tokens):
    model.zero_grad(set_to_none=True)
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).logits
    loss, _ = sft_loss(logits, batch.labels, num_tokens=num_tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_loss_and_gradient_equal_unpacked(model):
    """Cross-contamination would change every sample after the first in a row."""
    generator = torch.Generator().manual_seed(0)
    samples = []
    for length in (7, 12, 5, 9, 3, 11):
        ids = torch.randint(3, 500, (length,), generator=generator).tolist()
        samples.append(demo(ids, length // 2))
    tokens = sum(sum(s.targets) for s in samples)
    packed = pack_sequences(samples, 24, PAD, "cpu")
    assert len(packed) < len(samples)  # several samples share rows
    unpacked_loss, unpacked_grads = _loss_and_grads(
        model, pad_sequences(samples, PAD, "cpu"), tokens
    )
    packed_loss, packed_grads = _loss_and_grads(model, packed, tokens)
    torch.testing.assert_close(packed_loss, unpacked_loss, rtol=1e-5, atol=1e-6)
    for name, grad in unpacked_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packing_without_position_restarts_would_leak(model):
    """The check above has teeth: one causal sequence over the same row gives another loss."""
    samples = [demo([5, 6, 7, 8, 9], 1), demo([10, 11, 12, 13], 1)]
    packed = pack_sequences(samples, 9, PAD, "cpu")
    tokens = sum(sum(s.targets) for s in samples)
    leaked = copy.copy(packed)
    leaked.position_ids = torch.arange(9).unsqueeze(0)
    separate, _ = _loss_and_grads(model, packed, tokens)
    joined, _ = _loss_and_grads(model, leaked, tokens)
    assert abs(float(separate) - float(joined)) > 1e-3


def test_left_padded_sequence_logprobs_match_each_row_alone(model):
    prompts, completions = [[5, 6, 7, 8, 9], [10, 11]], [[12, 13], [14, 15, 16]]
    with torch.no_grad():
        together = sequence_sums(model, pad_completions(prompts, completions, PAD, "cpu"))
        alone = torch.cat(
            [
                sequence_sums(model, pad_completions([p], [c], PAD, "cpu"))
                for p, c in zip(prompts, completions, strict=True)
            ]
        )
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
