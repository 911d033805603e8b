"""What tests need: fakes and emulated graphs for CPU runs, tolerances, the conformance kit.

The reference workload the tests drive (runners, config, model, KV cache, batches,
registry) is :mod:`cuda_graph_runner.testing.workload`, the one module a plugin's tests
import for it (they import the core through :mod:`cuda_graph_runner.backend` and this
package only); this package may import every layer but the command.
"""
