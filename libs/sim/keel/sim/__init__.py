"""Keel's fleet simulator: the real controller's decider driven on a simulated clock (``engine``), failure
traces from a YAML mix (``trace``), cost-model baselines on the same trace (``baselines``), ETTR and lost
time (``metrics``), all systems in one run (``run``). docs/fleet-sim.md says what is real and what is a model."""
