"""Same plan, same machine, same thread count: the same run, bit for bit.

A worker calls make_deterministic once, before it builds anything. What it fixes, and why:

- torch's deterministic algorithms. The learner's shared-prefix forward
  (rollout.runtime.online.shared_prefix) repeats each prompt's logits and keys and values across
  the rows that share it (`x[rows]`, rows like [0, 0, 0, 0]). The backward of that indexing is an
  index_put_ with accumulate=True, which torch runs on the CPU with two or more threads as atomic
  float adds from every thread: the order of the adds, hence the last bits of the gradient,
  depends on how the threads happen to be scheduled. One such step was enough for two runs of one
  plan to drift apart. The deterministic path runs those adds in order, and costs nothing
  measurable on SmolLM2 (generation 1.03x the tokens per second, a learner step 0.99x the time:
  noise; docs/runs.md, "Reproducibility").
- Python's, numpy's and torch's global generators, seeded from the rank's seed, so that anything
  drawing from them (a reward plugin, a library) draws the same numbers in every run. A resumed
  run restores them from the checkpoint (rollout.runtime.run_state).

Not needed, measured on the machines we run (oneDNN 3.12, MKL 2024.2): oneDNN's packed linear and
MKL's sgemm gave the same bits whatever the alignment of their inputs and the load on the cores,
so MKL_CBWR (MKL's conditional numerical reproducibility) is not set.
"""

from __future__ import annotations

import os
import random


def make_deterministic(seed: int) -> None:
    """Seed Python's, numpy's and torch's global random generators with `seed` (the rank's seed
    from the plan) and have torch choose deterministic kernels. Call it once per process, before
    any model or engine is built.

    Unseeded generators of an engine or a data stream are not touched: they are seeded where
    they are made. Ops without a deterministic kernel (some CUDA ones) warn rather than fail, so
    a run that worked before still runs; docs/runs.md says what is guaranteed."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    # cuBLAS reads this when it first makes a handle; without it a deterministic CUDA run fails.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    # NaN-filling every torch.empty proves nothing a correct program needs, and costs time.
    torch.utils.deterministic.fill_uninitialized_memory = False
