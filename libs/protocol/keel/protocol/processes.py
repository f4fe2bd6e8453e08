"""Process names shared by the node agent (which sets them) and local tooling (which looks for them)."""

ZYGOTE_NAME = "keel-zygote"
"""The process name of an agent's warm-interpreter zygote (``/proc/PID/comm``); its forks are ranks."""
