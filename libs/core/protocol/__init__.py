"""Generated protobuf modules for the contracts under ``proto/`` (regenerate with ``make proto``).

``node_local_pb2``: the node-local channel between training ranks (keel.sdk) and the node agent.
"""
