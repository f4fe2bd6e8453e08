"""keel.kernel: the decider kernel (``decider``: Decider, Decision, deterministic decision ids) and
``replay`` (fold a recorded log through a decider and diff its decisions). Pure: no I/O, no clock."""
