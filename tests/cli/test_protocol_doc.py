"""docs/protocol.md stays true: its schema block is the code's, and every example parses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest

from gpusched.protocol import RESULT_TYPES, ErrorResponse, json_schema, parse_request
from gpusched_cli import gen_protocol_doc

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
REGENERATE = "regenerate it with `python -m gpusched_cli.gen_protocol_doc` (from the repository root)"


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def test_embedded_schema_matches_the_code() -> None:
    embedded = gen_protocol_doc.embedded_schema(_doc())
    assert embedded is not None, f"{DOC} has no generated JSON Schema block; {REGENERATE}"
    if embedded != gen_protocol_doc.schema_text():
        pytest.fail(f"the JSON Schema at the end of {DOC} differs from gpusched.protocol; {REGENERATE}")


def test_embedded_schema_is_exactly_the_sorted_dump() -> None:
    embedded = gen_protocol_doc.embedded_schema(_doc())
    assert embedded == json.dumps(json_schema(), indent=2, sort_keys=True)


def test_regenerating_is_idempotent_and_keeps_the_prose(tmp_path: Path) -> None:
    stale = _doc().replace('"type": "object"', '"type": "objekt"', 1)
    path = tmp_path / "protocol.md"
    path.write_text(stale, encoding="utf-8")
    assert gen_protocol_doc.main(["--check", str(path)]) == 1
    assert gen_protocol_doc.main([str(path)]) == 0
    assert path.read_text(encoding="utf-8") == _doc()
    assert gen_protocol_doc.main(["--check", str(path)]) == 0


def _examples() -> list[tuple[str | None, dict[str, Any]]]:
    """(the `### op` section it sits in, the object) for every ```json block before the schema."""
    prose = _doc().split(gen_protocol_doc.MARKER, 1)[0]
    out: list[tuple[str | None, dict[str, Any]]] = []
    section: str | None = None
    for match in re.finditer(r"^### (\w+)$|^```json\n(.*?)\n```$", prose, re.MULTILINE | re.DOTALL):
        if match.group(1):
            section = match.group(1)
        else:
            out.append((section, json.loads(match.group(2))))
    return out


def test_doc_has_examples_for_every_request_and_result() -> None:
    examples = _examples()
    requests = {obj["op"] for _, obj in examples if "op" in obj}
    results = {section for section, obj in examples if obj.get("ok") is True and section}
    assert requests == set(RESULT_TYPES)
    assert results == set(RESULT_TYPES)


@pytest.mark.parametrize(("section", "obj"), _examples())
def test_every_example_is_valid(section: str | None, obj: dict[str, Any]) -> None:
    schema = json_schema()
    if "op" in obj:
        assert obj["op"] == section, f"a {obj['op']} request under ### {section}"
        parse_request(obj)
        jsonschema.validate(obj, {**schema["request"], "$defs": schema["$defs"]})
    elif obj.get("ok") is False:
        ErrorResponse.model_validate(obj)
    else:
        assert obj.get("ok") is True and set(obj) == {"ok", "result"}
        op = section if section in RESULT_TYPES else "submit"  # the framing section shows a submit reply
        RESULT_TYPES[op].model_validate(obj["result"])
        jsonschema.validate(obj["result"], {**schema["results"][op], "$defs": schema["$defs"]})
