"""The node agent: a torchrun-compatible launcher and supervisor of one node's ranks, the node side of
the inspector (probes, rank heartbeats over the node-local channel), and the executor of commands
addressed to its node. It turns observations into events; it decides nothing on its own beyond the
inspector's pure core."""
