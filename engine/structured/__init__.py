"""Structured output through llguidance: `response_format` validation and per-row masks.

`formats` turns a request's `response_format` into a checked grammar (or a
`ResponseFormatError` naming the field); `masks` runs one matcher per constrained row
and computes its next-token masks on a worker thread, off the runner's critical path.
"""

from tqserve.engine.structured.formats import (ResponseFormat, ResponseFormatError,
                                       validate_response_format)
from tqserve.engine.structured.masks import GrammarMasks, GrammarStatistics, RowGrammar

__all__ = ["GrammarMasks", "GrammarStatistics", "ResponseFormat", "ResponseFormatError",
           "RowGrammar", "validate_response_format"]
