"""keel.checkpoint_broker: backup placement, per-tier commits, the persistent-tier schedule and restore plans."""
