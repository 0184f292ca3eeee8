"""handoff: release, resume and reload LLM inference memory across a cluster, safely.

Packages of this distribution, one per process:
- ``node_engine``: the LLM engine (one per GPU), memory in tagged regions.
- ``node_sidecar``: the node's only door; serializes release against generation.
- ``lb``: the control-plane load balancer, one URL for the cluster.
- ``handoff``: the ``handoff`` command (``up``, ``demo``), the Python client, and
  ``handoff.service``, the HTTP plumbing the three services share.
"""

__version__ = "0.1.0"
