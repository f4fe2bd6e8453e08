"""keel.events: the event catalogue, the bottom layer of Keel.

``envelope``: the one envelope (ids, subjects, encoding, upcasting, the registry); ``types``: every event
type; ``catalogue``: the JSON Schema catalogue (``schema.json``, shipped as package data); ``units``:
durations and sizes with units. Importing the package registers every event type in ``REGISTRY``.
"""

from keel.events import types as _types  # noqa: F401  (fills keel.events.envelope.REGISTRY)
