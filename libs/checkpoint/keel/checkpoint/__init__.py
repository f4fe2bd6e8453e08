"""keel.checkpoint: the checkpoint formats shared by the SDK, the node agent and the broker.

``slots``: the double-buffered shared-memory slots a rank snapshots into; ``disk``: the persistent
tier's layout (shards, manifest written last, hashes). Pure Python: no torch.
"""
