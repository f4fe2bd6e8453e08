"""Keel's HTTP API: what ``keel incidents``, ``keel timeline``, ``keel ettr``, ``keel audit`` and ``keel events``
answer, as JSON over HTTP behind bearer tokens (``keel.infra.api_auth``), with its OpenAPI spec at ``/openapi.json``."""
