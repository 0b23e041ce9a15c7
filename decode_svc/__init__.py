"""The decode service: Generate (prefill peer, one NIXL READ per rank pair, decode loop)."""
