"""Microbenchmarks of single components: the cache's own overhead, sandboxes, the server, Redis."""
