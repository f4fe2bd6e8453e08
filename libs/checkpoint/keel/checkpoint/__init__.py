"""keel.checkpoint: the checkpoint formats shared by the SDK, the node agent and the broker.

``slots``: the double-buffered shared-memory slots a rank snapshots into; ``disk``: the persistent
tier's layout (shards, manifest written last, hashes); ``owned``: node-local folders and files under
predictable paths, used only when this user's own (no symbolic link followed). Pure Python: no torch.
"""
