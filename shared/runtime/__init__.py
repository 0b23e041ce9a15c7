"""What a service process runs: its engine host (layout, caches, agents, poller, allocator, engine)."""
