"""A vLLM replica simulator for guardian's tests and demo (see server.py)."""
