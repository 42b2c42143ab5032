"""Benchmarks: scripts that print figures and ratios against a baseline from the same run.

Run them as ``python bench/<name>.py`` from the repository root (see ``bench/README.md``).
"""
