"""The response probe, re-exported from :mod:`opbc_metrics.functional.endpoint` (where it lives, with the
rules of every capability flag)."""

from opbc_metrics.functional.endpoint import CHAT_COMPLETION, TEXT_COMPLETION, EndpointCapabilities, probe_response

__all__ = ["CHAT_COMPLETION", "TEXT_COMPLETION", "EndpointCapabilities", "probe_response"]
