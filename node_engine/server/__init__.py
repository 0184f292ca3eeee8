"""The engine's HTTP server (SPEC section 5)."""
