"""Actuators: carry out the controller's commands on the machines (``local`` here; ``slurm`` and
``kubernetes`` plug into the same ``Actuator`` protocol). Pure outcome rules in ``core``, the local
cluster's implementation in ``local``, the command consumer in ``adapter``."""
