"""The controller: the per-job escalation ladder (pure core in ``core``; I/O in ``adapter``)."""
