"""The prefill service: Handshake and the Session stream (jobs in, manifests out), leases."""
