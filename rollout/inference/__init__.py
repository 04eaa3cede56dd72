"""Batch inference: `rollout generate` samples completions for a file of prompts, resumably.

model_choice.py  which model: a config's [model], a path, GGUF or builtin, or a run's checkpoint
output.py        the output file (JSONL or Parquet), written so an interrupted job resumes
remote_output.py an s3:// or gs:// output: staged locally, checked first, uploaded whole
batch.py         the job: settings, encoding, the generation loop

The prompt file (JSONL or Parquet, local or fsspec) is read and checked record by record by
rollout.planner.prompt_files, which `rollout eval` and a run's [[eval.suites]] read rows with too.
"""
