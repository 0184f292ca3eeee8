"""``HandoffClient`` / ``AsyncHandoffClient``: what an RL orchestrator imports to drive a cluster.

::

    from handoff.client import HandoffClient, FanoutFailed

    with HandoffClient("http://lb:8000", admin_token=TOKEN) as cluster:
        rollouts = cluster.generate(text=prompts, sampling_params={"max_new_tokens": 256})
        cluster.release(mode="wait")                 # every node drains, then frees its memory
        ...                                           # train
        cluster.resume(tags=["weights"])
        cluster.update_weights_from_disk("/ckpt/step-12", weight_version="step-12")
        cluster.resume(tags=["kv_cache", "cuda_graph", "workspace"])
        cluster.flush_cache()

Errors: a 502 from the LB (some nodes failed a control call) raises
:class:`FanoutFailed` with the failures and the successes per node; a 503
raises :class:`ServiceUnavailable` carrying ``retry_after`` (seconds; None
when the header is absent or not a number of seconds, and the policy's
default applies), after the retries the caller's :class:`RetryPolicy`
allows; anything else non-2xx raises :class:`HandoffError` with the status
and the envelope's type. A stream raises :class:`HandoffError` on an error
event (its type), when it ends without ``[DONE]`` or its connection breaks
(``incomplete_stream``), or on an event that is not a JSON object within
bounds or never ends (``invalid_stream``), once the events before it are
yielded; a 503 before a stream starts is retried like any other call's.

Nothing else escapes (``handoff/client/answers.py``): status 0 with
``unreachable`` (nothing was sent), ``timeout`` (the whole answer did not
arrive within the call's timeout, however the server dribbles it) or
``incomplete_response``; ``invalid_response`` for a 2xx that is not JSON
within bounds, longer than ``max_answer_bytes`` or not of the call's shape (``generate``: an object for one
prompt, a list of objects for a batch or ``n`` > 1; ``memory_occupation``: an object); ``control_failed`` for a
control answer that says ``"success": false`` or lists a node that failed. Pointed at one sidecar, a
control call returns that node's answer as a one-node :class:`FanoutResult`.
"""

from handoff.client.aio import AsyncHandoffClient
from handoff.client.calls import RetryPolicy
from handoff.client.errors import FanoutFailed, FanoutResult, HandoffError, NodeResult, ServiceUnavailable
from handoff.client.sync import HandoffClient

__all__ = ["AsyncHandoffClient", "FanoutFailed", "FanoutResult", "HandoffClient", "HandoffError", "NodeResult",
           "RetryPolicy", "ServiceUnavailable"]
