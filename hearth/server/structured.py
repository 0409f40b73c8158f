"""Every way clients ask for structured output, read into one StructuredOutputsParams.

OpenAI: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}} (the schema is enforced whatever `strict` says, as vLLM does).
vLLM: `structured_outputs` {json | regex | choice | grammar | json_object, disable_any_whitespace}
and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
llama.cpp: `grammar` (GBNF), `json_schema`, and a `schema` inside a json_object response_format.
A request may use one of them; a schema or grammar that cannot be compiled is refused when the
engine takes the request (400 naming the problem).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hearth.errors import RequestError
from hearth.sampling_params import StructuredOutputsParams


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JsonSchemaFormat(_Fields):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama.cpp: a schema for json_object


class StructuredOutputFields(_Fields):
    """The request fields that ask for structured output (mixed into both generation requests)."""

    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        asked: dict[str, StructuredOutputsParams] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise RequestError("response_format of type json_schema needs json_schema.schema")
            asked["response_format"] = StructuredOutputsParams(json=rf.json_schema.schema_)
        elif rf is not None and rf.type == "json_object":
            asked["response_format"] = (StructuredOutputsParams(json=rf.schema_) if rf.schema_ is not None
                                        else StructuredOutputsParams(json_object=True))
        if self.structured_outputs is not None:
            try:
                asked["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
            except TypeError:
                known = ", ".join((*StructuredOutputsParams.KINDS, "disable_any_whitespace"))
                raise RequestError(f"structured_outputs takes {known}; got {sorted(self.structured_outputs)}") from None
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar"), ("grammar", "grammar"), ("json_schema", "json")):
            value = getattr(self, field)
            if value is not None:
                asked[field] = StructuredOutputsParams(**{kind: value})
        if len(asked) > 1:
            raise RequestError(f"give one way of constraining the output, not several: {', '.join(asked)}")
        return next(iter(asked.values()), None)
