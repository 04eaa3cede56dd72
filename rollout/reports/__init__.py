"""Run reports: one self-contained HTML page (inline CSS, JS and SVG; nothing fetched) that shows
a run's curves, step times, evaluation scores, plan and sample completions (`rollout report`)."""
