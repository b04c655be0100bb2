"""What the hub takes as a job's result from a worker node (docs/nodes.md, "What the hub takes
from a node"): a JSON object, not nested deeper than :data:`MAX_RESULT_DEPTH`, at most
:data:`MAX_RESULT_BYTES` as JSON, and of its kind's result shape when the kind declares one.
Plain functions; a result that fails is a failed attempt (``invalid_result``), never a
``succeeded`` job.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

#: Levels of nesting a result may have (the kinds' own results have at most 4).
MAX_RESULT_DEPTH = 16
#: Bytes of JSON a result may take (the kinds' own: a few KiB; a transcript's summary 4,000 characters).
MAX_RESULT_BYTES = 256 * 1024


def depth(value: Any, limit: int) -> int:
    """Levels of lists and objects in ``value``, counted up to ``limit + 1`` without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def result_problem(result: Any, shape: type[BaseModel] | None = None) -> str | None:
    """Why ``result`` (a node's, parsed from JSON) cannot be a job's result, or None."""
    if not isinstance(result, dict):
        return f"the result is {type(result).__name__}, not an object"
    if depth(result, MAX_RESULT_DEPTH) > MAX_RESULT_DEPTH:
        return f"the result is nested deeper than {MAX_RESULT_DEPTH} levels"
    try:
        size = len(orjson.dumps(result))
    except (TypeError, orjson.JSONEncodeError) as e:
        return f"the result cannot be stored as JSON: {e}"
    if size > MAX_RESULT_BYTES:
        return f"the result is {size} bytes of JSON, over {MAX_RESULT_BYTES}"
    if shape is not None:
        try:
            shape.model_validate(result, strict=True)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(the result)"
            return f"{where}: {err['msg']}"
    return None
