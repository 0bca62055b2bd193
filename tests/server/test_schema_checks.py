"""unsatisfiable(): JSON schemas with no finite instance (recursion with no base case) are
found before llguidance sees them; recursive schemas with a way out pass."""

from __future__ import annotations

import pytest

from muser.server.structured import unsatisfiable

NO_BASE = [{"$ref": "#"},
           {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
           {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
           {"anyOf": [{"$ref": "#"}, {"$ref": "#/anyOf/0"}]},
           {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
           {"type": "object", "properties": {"x": {"allOf": [{"$ref": "#"}]}}, "required": ["x"]}]
WITH_BASE = [{}, {"type": "object"},
             {"type": "object", "properties": {"a": {"$ref": "#"}}},
             {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}}]},
             {"type": "array", "items": {"$ref": "#"}},
             {"$defs": {"node": {"type": "object", "properties": {
                 "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                 "required": ["next"]}}, "$ref": "#/$defs/node"},
             {"type": ["object", "string"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}]


@pytest.mark.parametrize("schema", NO_BASE)
def test_recursion_with_no_base_case_is_found(schema: dict) -> None:
    assert "no finite instance" in unsatisfiable(schema)


@pytest.mark.parametrize("schema", WITH_BASE)
def test_recursion_with_a_way_out_passes(schema: dict) -> None:
    assert unsatisfiable(schema) is None


def test_a_wide_schema_is_searched_in_bounded_time() -> None:
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 3} for i in range(60)}
    defs["d60"] = {"type": "integer"}
    assert unsatisfiable({"$defs": defs, "$ref": "#/$defs/d0"}) is None


def test_a_check_past_its_time_is_refused_and_its_worker_replaced(gguf_reader) -> None:
    import asyncio
    import dataclasses

    from muser.constraint import GrammarError, GrammarLimits
    from muser.server.grammar_check import GrammarCheck
    from muser.tokenizer import Tokenizer

    async def run() -> None:
        check = GrammarCheck(Tokenizer.from_gguf(gguf_reader), GrammarLimits())
        assert await check.check("schema", {"type": "integer"})
        check.limits = dataclasses.replace(check.limits, compile_s=1e-4)
        with pytest.raises(GrammarError, match="took more than"):
            await check.check("schema", {"type": "string", "pattern": "^(a{1000}){1000}$"})
        check.limits = GrammarLimits()
        for _ in range(3):  # NOTE: every worker, the replaced one too, once it is back
            assert await check.check("grammar", 'root ::= "x"')
        with pytest.raises(GrammarError, match="no finite instance"):
            await check.check("schema", {"$ref": "#"})
        check.close()

    asyncio.run(run())
