"""OpenTelemetry tracing: the spans of a request across both services (spans.py) and the SDK
set up from the standard OTEL_* variables (setup.py). Off unless configured."""
