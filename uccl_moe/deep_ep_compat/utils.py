"""``deep_ep.utils`` equivalents (Megatron imports ``from deep_ep.utils import EventHandle, EventOverlap``)."""

from ..utils import EventHandle, EventOverlap, check_nvlink_connections

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
