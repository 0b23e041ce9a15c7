"""Service logs: text or JSON lines, a request context every line of a request carries, and a
rate limit for repeated identical warnings (shared/logs/setup.py wires them together)."""
