"""The proxy family of the core: a replica's place at the proxy (its drain: the rows D1-D16 and the
tick's drain steps), clients that bypass the proxy (B1-B3), and nginx's retries read for `guardian
check`. Pure. Imports nothing: each module is imported by name (core/proxy/drain.py, ...)."""
