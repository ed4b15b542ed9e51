"""guardian: keeps local vLLM replicas serving (progress-based watchdog, memory guard)."""

__version__ = "0.2.0"
