"""[data]: where the prompts (or pairs, or demonstrations) come from and which fields mean what."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout.config.base import ConfigModel
from rollout.config.secrets import Location

FieldName = str


class DataSource(ConfigModel):
    path: Location = Field(
        min_length=1,
        description="A JSONL or Parquet file: a local path (relative to the config file's "
        "directory) or an fsspec URL (file://, s3://, gs://, ...).",
    )
    format: Literal["auto", "jsonl", "parquet"] = Field(
        default="auto",
        description="File format. 'auto' decides from the extension (.jsonl/.json/.ndjson or "
        ".parquet).",
    )
    limit: int | None = Field(
        default=None,
        ge=1,
        description="Use only the first this many records (after reading, before shuffling).",
    )


class FieldMap(ConfigModel):
    """Which record field plays which part. Unset parts are not used."""

    prompt: FieldName | None = Field(
        default="prompt",
        description="Field with the prompt text (or a list of chat messages).",
    )
    answer: FieldName | None = Field(
        default=None,
        description="Field with the reference answer that rule-based rewards compare against "
        "(passed to them as `answer`, in place of any record field of that name).",
    )
    completion: FieldName | None = Field(
        default=None,
        description="Field with the target completion (SFT) or the judged completion (KTO).",
    )
    messages: FieldName | None = Field(
        default=None,
        description="Field with a whole chat conversation (a list of {role, content}) for SFT.",
    )
    chosen: FieldName | None = Field(
        default=None,
        description="Field with the preferred completion (DPO, IPO, reward-model training).",
    )
    rejected: FieldName | None = Field(
        default=None,
        description="Field with the dispreferred completion (DPO, IPO, reward-model training).",
    )
    label: FieldName | None = Field(
        default=None,
        description="Field with a boolean: is this completion desirable (KTO).",
    )


class DataSection(ConfigModel):
    train: DataSource = Field(description="The training set.")
    eval: DataSource | None = Field(
        default=None,
        description="A held-out set for evaluation. None: no evaluation.",
    )
    fields: FieldMap = Field(
        default_factory=FieldMap,
        description="Which record fields hold the prompt, answer, completion, chosen, rejected, "
        "... Online, every mapped role reaches the rewards; offline, a role the objective does "
        "not read is refused (dpo, ipo, rm: prompt, chosen, rejected; kto: prompt, completion, "
        "label; sft: prompt and completion, or messages).",
    )
    shuffle: bool = Field(
        default=True,
        description="Shuffle the training set each epoch, deterministically from run.seed.",
    )
    use_chat_template: bool = Field(
        default=True,
        description="Wrap prompts in the model's chat template as a user turn before generation.",
    )
    system_prompt: str | None = Field(
        default=None,
        description="A system message put before every prompt; needs use_chat_template. Refused "
        "for sft on data.fields.messages, whose conversations are trained on as written.",
    )
