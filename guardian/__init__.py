"""guardian: keeps local vLLM replicas serving (progress-based watchdog, memory guard)."""

__version__ = "0.1.0"
