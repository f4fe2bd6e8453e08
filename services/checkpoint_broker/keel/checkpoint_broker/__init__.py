"""keel.checkpoint_broker: backup placement, per-tier commits, the persistent-tier schedule and restore plans.

Pure (no I/O; import-linter keeps it so): ``decider`` (the Decider) over ``state`` (the state and its
fold), ``placement``, ``schedule`` and ``restore`` (the decisions and their maths). I/O: ``adapter``
(the decider loop, manifests, the clock) and ``main`` (the service).
"""
