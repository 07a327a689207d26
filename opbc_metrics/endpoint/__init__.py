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

from opbc_metrics.endpoint.metrics import (
    ENDPOINT_METRICS,
    EndpointResponseCount,
    SampledLogprobsCoverage,
    SeedSupportCoverage,
    TokenIdsCoverage,
    TopLogprobsCoverage,
    endpoint_section,
)
from opbc_metrics.functional.endpoint import CHAT_COMPLETION, TEXT_COMPLETION, EndpointCapabilities, probe_response

__all__ = [
    "CHAT_COMPLETION",
    "ENDPOINT_METRICS",
    "TEXT_COMPLETION",
    "EndpointCapabilities",
    "EndpointResponseCount",
    "SampledLogprobsCoverage",
    "SeedSupportCoverage",
    "TokenIdsCoverage",
    "TopLogprobsCoverage",
    "endpoint_section",
    "probe_response",
]
