"""Hot-update: code versions (``keel deploy``), their rollout policy and stability (see ``core``)."""
