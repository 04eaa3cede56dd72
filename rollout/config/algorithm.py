"""[algorithm]: the training objective, a tagged union on `kind`.

Each branch carries only its own knobs, so an error in a GRPO config talks about GRPO fields.
Cross-field rules (divisibility of batch sizes, fields the data must have) live in rules.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rollout.config.base import ConfigModel

LrSchedule = Literal["constant", "linear", "cosine"]
KlEstimator = Literal["k1", "k2", "k3"]
LossAggregation = Literal["token_mean", "sequence_mean", "batch_token_mean", "constant"]
ReferenceMode = Literal["cached", "live"]
Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimizerKnobs(ConfigModel):
    """AdamW and its learning-rate schedule; shared by every algorithm."""

    lr: float = Field(default=1e-6, gt=0, le=1.0, description="Peak learning rate (AdamW).")
    lr_schedule: LrSchedule = Field(
        default="constant",
        description="Learning-rate schedule after warmup: constant, linear decay to 0, or cosine.",
    )
    warmup_steps: int = Field(
        default=0,
        ge=0,
        description="Optimizer steps of linear warmup to lr: optimizer step s < warmup_steps runs "
        "at lr x (s + 1) / warmup_steps. 0: none (1 would be none too, and is refused).",
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_betas: tuple[Beta, Beta] = Field(
        default=(0.9, 0.999), description="AdamW (beta1, beta2), each in [0, 1)."
    )
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(
        default=1.0, gt=0, description="Clip the global gradient norm to this. None: no clipping."
    )
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Sequences per forward/backward pass; gradients accumulate up to the "
        "minibatch. None: the whole minibatch in one pass. Lower it to save memory.",
    )


class OnPolicyKnobs(OptimizerKnobs):
    """Knobs shared by the online RL algorithms (generate, score, update)."""

    max_steps: int = Field(
        default=100, ge=1, description="Training steps; each step generates one rollout batch."
    )
    rollout_batch_size: int = Field(
        default=8,
        ge=1,
        description="Completions generated per step (prompts per step x num_generations).",
    )
    num_generations: int = Field(
        default=4, ge=1, description="Completions sampled per prompt (the group size)."
    )
    minibatch_size: int | None = Field(
        default=None,
        ge=1,
        description="Completions per optimizer step; must divide rollout_batch_size. None: the "
        "whole rollout batch (one optimizer step per update epoch).",
    )
    update_epochs: int = Field(
        default=1, ge=1, description="Passes over each rollout batch (PPO/GRPO 'mu')."
    )
    clip_ratio_low: float = Field(
        default=0.2, gt=0, lt=1, description="Lower clip of the importance ratio: 1 - this."
    )
    clip_ratio_high: float = Field(
        default=0.2,
        gt=0,
        description="Upper clip of the importance ratio: 1 + this (DAPO 'clip-higher' uses 0.28).",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the KL penalty to the frozen reference model. 0: no reference model "
        "is loaded at all.",
    )
    kl_estimator: KlEstimator = Field(
        default="k3",
        description="KL estimator: k1 (log-ratio), k2 (squared log-ratio / 2) or k3 (unbiased, "
        "always positive), of the KL term in the loss (grpo, rloo, ppo with kl_penalty = 'loss') "
        "when kl_coef > 0. The KL in the token rewards (ppo's kl_penalty = 'reward', "
        "reinforce_pp) is always k1: setting it there, or with kl_coef = 0, is refused.",
    )
    loss_aggregation: LossAggregation = Field(
        default="token_mean",
        description="How per-token losses become one number: token_mean (mean over the "
        "minibatch's tokens), sequence_mean (mean per sequence, then over sequences), "
        "batch_token_mean (DAPO: over the minibatch's tokens across every data-parallel rank; "
        "with one learner process the same as token_mean), constant (Dr. GRPO: sum / "
        "(sequences x max_new_tokens)).",
    )
    max_staleness: int = Field(
        default=0,
        ge=0,
        le=64,
        description="Asynchronous training with a disaggregated placement (actors and learners on "
        "separate processes): the actors generate the next batches with weights up to this many "
        "policy versions old while the learners train. 0: synchronous (every batch is sampled "
        "from the newest weights). With colocated roles there is nothing to overlap: keep 0.",
    )
    stale_samples: Literal["tis", "drop"] = Field(
        default="tis",
        description="What the learner does with a batch sampled by an older policy (max_staleness "
        "> 0), from the log-probs of the policy it is training (its own forward pass): 'tis' "
        "weighs each token by the truncated importance ratio min(current / sampling "
        "probability, tis_bound); 'drop' gives weight 0 to the sequences where any token's "
        "ratio leaves [1 / tis_bound, tis_bound].",
    )
    tis_bound: float = Field(
        default=2.0,
        gt=1.0,
        le=1000.0,
        description="The importance ratio's bound for stale samples: tokens' weights are "
        "truncated at it ('tis'), or sequences leaving [1 / tis_bound, tis_bound] dropped "
        "('drop').",
    )


class GrpoConfig(OnPolicyKnobs):
    """GRPO: advantages relative to the other completions of the same prompt."""

    kind: Literal["grpo"] = Field(description="Group Relative Policy Optimization.")
    num_generations: int = Field(
        default=4,
        ge=2,
        description="Completions sampled per prompt (the group size); at least 2, since "
        "advantages are relative to the group.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        default="group",
        description="Divide advantages by the reward std of the group, of the whole batch, or not "
        "at all (Dr. GRPO).",
    )


class RlooConfig(OnPolicyKnobs):
    """RLOO: each completion is baselined on the mean reward of the others."""

    kind: Literal["rloo"] = Field(description="REINFORCE Leave-One-Out.")
    num_generations: int = Field(
        default=4,
        ge=2,
        description="Completions sampled per prompt; at least 2 (each is baselined on the others).",
    )


class PpoConfig(OnPolicyKnobs):
    """PPO: a learned critic gives per-token values; advantages by GAE."""

    kind: Literal["ppo"] = Field(description="Proximal Policy Optimization with a learned critic.")
    num_generations: int = Field(default=1, ge=1, description="Completions sampled per prompt.")
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount factor for GAE.")
    lam: float = Field(default=0.95, ge=0, le=1, description="GAE lambda.")
    critic: Literal["value_head", "separate"] = Field(
        default="separate",
        description="A separate value model (initialised from the policy) or a value head on the "
        "policy itself.",
    )
    critic_lr: float = Field(
        default=1e-5,
        gt=0,
        le=1.0,
        description="Learning rate of the critic: the separate value model, or the value head "
        "(critic = 'value_head', whose shared trunk trains with the policy at lr).",
    )
    vf_coef: float = Field(
        default=0.5,
        ge=0,
        description="Weight of the value loss added to the policy loss, with critic = "
        "'value_head'. A separate critic has an optimizer of its own, where a weight means "
        "nothing: setting it there is refused (tune critic_lr).",
    )
    value_clip: float | None = Field(
        default=0.2, gt=0, description="Clip value updates to this range. None: no clipping."
    )
    whiten_advantages: bool = Field(
        default=True, description="Normalize advantages to zero mean and unit std per batch."
    )
    kl_penalty: Literal["reward", "loss"] = Field(
        default="reward",
        description="Apply the KL to the reference as a per-token reward penalty (classic PPO) or "
        "as a loss term. Needs kl_coef > 0 (refused otherwise).",
    )


class ReinforcePpConfig(OnPolicyKnobs):
    """REINFORCE++: no critic; KL-shaped token rewards, their returns whitened over the batch."""

    kind: Literal["reinforce_pp"] = Field(
        description="REINFORCE++ (critic-free, globally normalized advantages)."
    )
    num_generations: int = Field(default=1, ge=1, description="Completions sampled per prompt.")
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount of the token returns.")
    baseline: Literal["none", "group"] = Field(
        default="none",
        description="'group' (REINFORCE++-baseline) subtracts the mean reward of the prompt's "
        "completions first; needs num_generations >= 2.",
    )


class OfflineKnobs(OptimizerKnobs):
    """Knobs shared by algorithms that train on a fixed dataset."""

    batch_size: int = Field(default=8, ge=1, description="Samples (or pairs) per optimizer step.")
    epochs: int = Field(default=1, ge=1, description="Passes over the training set.")
    max_steps: int | None = Field(
        default=None, ge=1, description="Stop after this many optimizer steps, even mid-epoch."
    )
    max_length: int = Field(
        default=1024,
        ge=8,
        description="Longest tokenized sample (prompt + completion); longer ones are an error at "
        "plan time.",
    )


class PreferenceKnobs(OfflineKnobs):
    """Knobs shared by the preference objectives (DPO, IPO, KTO)."""

    beta: float = Field(default=0.1, gt=0, description="Strength of the implicit KL constraint.")
    reference: ReferenceMode = Field(
        default="cached",
        description="'cached': reference log-probs are computed once and stored in the run "
        "directory; 'live': the reference model runs every step.",
    )


class DpoConfig(PreferenceKnobs):
    """DPO: the policy's log-ratio margin over the reference, on preference pairs."""

    kind: Literal["dpo"] = Field(description="Direct Preference Optimization.")
    label_smoothing: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="Conservative DPO: assumed probability that a preference label is flipped.",
    )


class IpoConfig(PreferenceKnobs):
    """IPO: DPO with a squared loss that does not saturate."""

    kind: Literal["ipo"] = Field(description="Identity Preference Optimization.")


class KtoConfig(PreferenceKnobs):
    """KTO: unpaired desirable and undesirable completions."""

    kind: Literal["kto"] = Field(description="Kahneman-Tversky Optimization on unpaired data.")
    desirable_weight: float = Field(
        default=1.0, gt=0, description="Loss weight of desirable examples."
    )
    undesirable_weight: float = Field(
        default=1.0, gt=0, description="Loss weight of undesirable examples."
    )


class SftConfig(OfflineKnobs):
    """SFT: next-token cross-entropy on demonstrations."""

    kind: Literal["sft"] = Field(description="Supervised fine-tuning.")
    lr: float = Field(default=2e-5, gt=0, le=1.0, description="Peak learning rate (AdamW).")
    completion_only_loss: bool = Field(
        default=True, description="Compute the loss on completion tokens only, not the prompt."
    )
    packing: bool = Field(
        default=False,
        description="Pack several samples into one sequence of max_length (attention never "
        "crosses sample boundaries).",
    )


class RmConfig(OfflineKnobs):
    """Reward model: a scalar head trained with a Bradley-Terry loss on pairs."""

    kind: Literal["rm"] = Field(description="Reward-model training (Bradley-Terry on pairs).")
    lr: float = Field(default=1e-5, gt=0, le=1.0, description="Peak learning rate (AdamW).")
    center_rewards_coef: float | None = Field(
        default=None,
        ge=0,
        description="Weight of a penalty that keeps rewards centred on zero. None: off.",
    )


AlgorithmConfig = Annotated[
    GrpoConfig
    | PpoConfig
    | RlooConfig
    | ReinforcePpConfig
    | DpoConfig
    | IpoConfig
    | KtoConfig
    | SftConfig
    | RmConfig,
    Field(discriminator="kind"),
]

ONLINE_KINDS = ("grpo", "ppo", "rloo", "reinforce_pp")
OFFLINE_KINDS = ("dpo", "ipo", "kto", "sft", "rm")
PAIRED_PREFERENCE_KINDS = ("dpo", "ipo", "rm")
REFERENCE_KINDS = ("dpo", "ipo", "kto")
