"""The eval harness: scorers over (data row, completion text), and the statistics over samples.

numeric.py   GSM8K-style final numeric answers
ifeval.py    IFEval-style verifiable instructions (instruction ids + kwargs, as IFEval writes them)
choice.py    MMLU-style multiple choice: answer-letter extraction, and log-likelihood of choices
loglik.py    summed log-probs of continuation tokens under a causal LM (torch)
metrics.py   pass@k (unbiased), maj@k, and per-suite and per-category aggregation
scorers.py   the built-in scorers by name, one interface: fields, prompt, score

Plain functions and small classes over plain values; no config objects (DESIGN.md).
"""
