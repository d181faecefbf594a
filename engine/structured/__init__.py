"""Structured output through llguidance: `response_format` validation and per-row masks.

`formats` turns a request's `response_format` into a checked grammar (or a
`ResponseFormatError` naming the field), in two stages: a cheap check of shape and size,
then llguidance's compile on a large-stack worker thread (`worker`); `masks` runs one matcher per constrained row
and computes its next-token masks on a worker thread, off the runner's critical path.
"""

from tqserve.engine.structured.formats import (FormatSource, ResponseFormat, ResponseFormatError,
                                       check_response_format, compile_format,
                                       validate_response_format)
from tqserve.engine.structured.masks import GrammarMasks, GrammarStatistics, RowGrammar

from tqserve.engine.structured.worker import BigStackExecutor

__all__ = ["BigStackExecutor", "FormatSource", "GrammarMasks", "GrammarStatistics",
           "ResponseFormat", "ResponseFormatError", "RowGrammar", "check_response_format",
           "compile_format", "validate_response_format"]
