"""Adapters that drive models written outside this project through the runners.

* :mod:`.hf`: a Hugging Face transformers causal LM (transformers' own modeling code)
  over this library's :class:`~cuda_graph_runner.backend.forward_batch.ForwardBatch`, paged KV
  cache and marked attention op (needs ``cuda-graph-runner[transformers]``).
"""
