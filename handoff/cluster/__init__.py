"""Local clusters: processes of the three services on loopback (``handoff up``, the demo, the tests)."""
