"""Comparator sources for iterative preference training."""

from comlrl_lightning.comparators.api import (
    API_FORMAT_ALIASES,
    API_FORMATS,
    ApiComparator,
    ApiComparatorConfig,
    ComparatorAPIError,
    ComparatorAPIInsufficientBalanceError,
    normalize_api_format,
)

__all__ = [
    "API_FORMATS",
    "API_FORMAT_ALIASES",
    "ApiComparator",
    "ApiComparatorConfig",
    "ComparatorAPIError",
    "ComparatorAPIInsufficientBalanceError",
    "normalize_api_format",
]
