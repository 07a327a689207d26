"""Endpoint-capability coverage (section ``endpoint``) and the probe that reads one response.

Example:
    >>> from opbc_metrics import OPBCCollection
    >>> response = {"object": "chat.completion", "system_fingerprint": "fp_1",
    ...             "choices": [{"message": {"role": "assistant", "content": "Hi"}, "logprobs": None}]}
    >>> metrics = OPBCCollection(sections=["endpoint"])
    >>> metrics.update(endpoint_responses=[response], endpoint_requests={"seed": 3})
    >>> out = metrics.compute()
    >>> out["endpoint/capabilities/seed_supported"], out["endpoint/capabilities/sampled_logprobs_available"]
    (tensor(1., dtype=torch.float64), tensor(0., dtype=torch.float64))
"""

from opbc_metrics.endpoint import metrics, probe
from opbc_metrics.endpoint.metrics import *  # noqa: F403
from opbc_metrics.endpoint.probe import *  # noqa: F403

__all__ = metrics.__all__ + probe.__all__
