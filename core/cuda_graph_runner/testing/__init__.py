"""What tests need: fakes and emulated graphs for CPU runs, tolerances, the conformance kit.

The reference workload the tests drive (model, KV cache, batches) is
:mod:`cuda_graph_runner.reference`; this package may import every layer but the command.
"""
