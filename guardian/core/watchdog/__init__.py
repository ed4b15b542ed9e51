"""The watchdog family of the core: how a replica is judged (its liveness rows, L1-L22), its canary
(C1-C5), its track, and the tick's step 1 (verdicts.py). Pure. Imports nothing: each module is
imported by name (core/watchdog/judge.py, ...)."""
