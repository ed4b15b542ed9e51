"""Observers: turn systemd, /proc, NVML, journals and each replica's HTTP endpoints into the
core's immutable values. Imports the core, never guardian.act."""
