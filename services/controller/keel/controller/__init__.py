"""The controller: the per-job escalation ladder, a pure decider over the event log, and its I/O.

Where to look:

- ``decider``: ``ControllerDecider``, the kernel ``Decider`` (thin: fold, then dispatch to a rule).
- ``rules``: the ladder's rules, one per input event (``on_health``, ``on_exit``, ``on_tick`` ...), and
  the stop-time diagnostics verdict; the module docstring lists the rungs.
- ``actions``: ``ActionPlan``, one decision in the making: incidents, rungs (evict, diagnose, replay,
  recover, roll out, size the pool) and the guardrails every action goes through.
- ``state``: what the controller knows per job (``JobView``, ``OpenIncident`` ...) and the fold that
  rebuilds it from the log (``evolve_job``).
- ``policy``: ``ControllerPolicy``, every limit and timeout.
- ``guardrails``, ``standby``: the pure breakers and the standby pool's binomial model.
- ``adapter``, ``main``: the I/O (the shared decider runner plus the clock) and the service entry point.
"""
