"""The eval harness: scorers over (data row, completion text), and the statistics over samples.

numeric.py   GSM8K-style final numeric answers
ifeval.py    IFEval-style verifiable instructions (instruction ids + kwargs, as IFEval writes them)
choice.py    MMLU-style multiple choice: answer-letter extraction, and log-likelihood of choices
loglik.py    summed log-probs of continuation tokens under a causal LM (torch)
metrics.py   pass@k (unbiased), maj@k, and per-suite and per-category aggregation
scorers.py   the built-in scorers by name, one interface: fields, prompt, score
suites.py    running a checked suite: prompts encoded, completions sampled (or choices scored),
             scored; for `rollout eval` and a training run's [[eval.suites]] alike
results.py   a suite's summary, its report rows, its scores as run-store metrics

Plain functions and small classes over plain values; no config objects and no engines: the
caller passes its engine and its sampling parameters in (DESIGN.md).
"""
