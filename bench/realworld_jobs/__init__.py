"""The real-scenario suite's training scripts (they do not import perfloop) and their catalog
(`scenarios`), shared by ``bench/realworld.py`` and ``tests/integration/test_realworld.py``."""
