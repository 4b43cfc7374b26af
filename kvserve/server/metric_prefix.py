"""The prefix of every kvserve metric name: vLLM's names under ``kvserve:``.

Its own module so that the collectors ``metrics.py`` registers (``prefill_metrics.py``,
``tensor_parallel_metrics.py``) share it without importing ``metrics.py`` back.
"""

PREFIX = "kvserve:"
