"""Keel's shared kernel: events, bus, store, decider kernel, config and the embedded runtime.

Importing the package registers every event type (``keel.core.event_types``) in the shared registry.
"""

from keel.core import event_types as _event_types  # noqa: F401  (fills keel.core.events.REGISTRY)
