"""keel.protocol: the contracts between Keel's processes on one node and across nodes.

Generated from ``proto/`` (regenerate with ``make proto``): ``node_local_pb2`` (the node-local channel
between training ranks and the node agent), ``shard_store_pb2``/``shard_store_pb2_grpc`` (checkpoint
shard transfer between agents). Hand-written: ``replay`` (the SDC replay spec and result files between
the agent and its ranks), ``processes`` (process names the agent sets and local tooling looks for).
"""
