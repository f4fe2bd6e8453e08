"""keel.cluster: a local cluster on this machine (``keel cluster up``): its ``cluster.json``, the node
agents' processes and fault injection. The ``local`` actuator and the CLI both drive it."""
