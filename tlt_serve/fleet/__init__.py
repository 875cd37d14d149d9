"""Many replicas behind sglang-router: the router's worker API, the router process, and the
``tlt-serve fleet`` launcher. Routing itself is sglang-router's; nothing here routes."""
