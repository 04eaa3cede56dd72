"""Helpers for tests and plugin authors; production code never imports them.

datasets.py          the small synthetic datasets under examples/data/, regenerated from a seed
tracker_output.py    reads back what each [logging] tracker wrote
lockfile_example.py  plan.lock.example, made comparable across machines

The builtin tiny models are a product feature and live in rollout.models.
"""
