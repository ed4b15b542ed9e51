"""Executors: perform the core's actions (journal lines, restarts, env and state files, sd_notify)."""
