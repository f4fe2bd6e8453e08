"""Keel's reports from the event log, torch-free, shared by the ``keel`` command and ``keel-api`` so the two cannot
disagree: incidents, timelines, ETTR and the human inputs built as events (``incidents``); the audit views
(``audit``)."""
