"""The reference workload: what ``cuda-graph-runner bench`` and the examples run.

A Llama-style model with paged attention (:mod:`.model`), its paged KV cache
(:mod:`.kv_cache`), batches and the greedy session (:mod:`.batches`), the trained-model
loaders (:mod:`.real_model`, :mod:`.models.hf`), tensor-parallel layers
(:mod:`.tensor_parallel`) and the speculative loop (:mod:`.speculative`). It uses the
runners and the backend contract; the tests' fakes and checks live in
:mod:`cuda_graph_runner.testing`.
"""
