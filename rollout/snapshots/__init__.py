"""Snapshots of a run (its plan, newest committed checkpoint and records), saved to a directory or
object store and restored as a new run on any store and artifacts: see docs/snapshots.md."""
