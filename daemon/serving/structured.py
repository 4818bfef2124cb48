"""Request fields that constrain the output: ``response_format``, vLLM's ``structured_outputs`` and
``guided_*`` extras, ``tools`` + ``tool_choice`` → one :class:`GrammarSpec` (or none) and, for
tool calls, a :class:`ToolCalling` saying how the reply becomes ``tool_calls``.

Accepted (at most one constraint per request; two are a 400 naming the second):

* ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (OpenAI).
* ``structured_outputs``: ``{"json": schema, "regex": str, "grammar": EBNF, "choice": [str],
  "json_object": true}``, exactly one of them (vLLM's ``StructuredOutputsParams``; its
  ``disable_*`` flags and ``whitespace_pattern`` are taken and ignored: llmd's JSON never has free
  whitespace anyway; any other key is a 400 naming it, as is one ``json_schema`` does not have).
* ``guided_json`` (a schema, or its JSON text), ``guided_regex``, ``guided_grammar``,
  ``guided_choice`` (vLLM's older names).
* ``tools`` (``[{"type": "function", "function": {"name", "description", "parameters"}}]``)
  with ``tool_choice``, as vLLM does: a named function (``{"type": "function", "function":
  {"name"}}``) constrains the output to that function's ``parameters`` schema (the output is
  the arguments); ``"required"`` to a JSON array of ``{"name", "parameters"}`` objects, one of
  the tools each (``parallel_tool_calls: false``: exactly one); ``"none"`` ignores the tools;
  ``"auto"`` (the default when tools are sent) needs a chat template that renders tools and a
  parser of that model's tool-call format, which llmd's models do not have: a 400 naming
  ``tool_choice``. Tools are for ``/v1/chat/completions`` only.

Structure is checked here (types, sizes: a schema or grammar of more than
:data:`MAX_GRAMMAR_CHARS` characters is refused); whether xgrammar can compile it is checked on
the engine loop's tokenizer pool before anything is queued (a :class:`RequestError` naming the
same field, also a 400). Every refusal is an :class:`ApiError` naming its field.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass

from llmd.daemon.core.grammar import GrammarSpec
from llmd.daemon.serving.validation import ApiError, json_typed, json_value

MAX_GRAMMAR_CHARS = 100_000  # characters of a schema's JSON text, a regex or a grammar
MAX_CHOICES = 256
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function name rule
GUIDED = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
SO_KEYS = {"json": "json", "regex": "regex", "grammar": "grammar", "choice": "choice", "json_object": "json_object"}
# vLLM's StructuredOutputsParams fields llmd takes without acting on them (its JSON has no free
# whitespace; there is no other backend to fall back to); structural_tag is refused on its own
SO_IGNORED = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
              "structural_tag")
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")  # OpenAI's response_format.json_schema


@dataclass(frozen=True)
class ToolCalling:
    """How a constrained reply becomes OpenAI ``tool_calls``.

    Attributes:
        name: the named function (its arguments are the whole output), or None for
            ``tool_choice: "required"`` (the output is ``[{"name", "parameters"}, ...]``).
    """

    name: str | None = None


def _text(v, field: str) -> str:
    if not isinstance(v, str) or not v:
        raise ApiError(f"{field} must be a non-empty string, got {json_typed(v)}", field)
    if len(v) > MAX_GRAMMAR_CHARS:
        raise ApiError(f"{field} has {len(v)} characters, more than the limit of {MAX_GRAMMAR_CHARS}", field)
    return v


def _schema(v, field: str) -> GrammarSpec:
    if isinstance(v, str):  # vLLM accepts the schema's JSON text too
        try:
            v = json.loads(_text(v, field))
        except json.JSONDecodeError as e:
            raise ApiError(f"{field} is not valid JSON: {e}", field) from None
    if not isinstance(v, dict):
        raise ApiError(f"{field} must be a JSON schema object, got {json_typed(v)}", field)
    spec = GrammarSpec.json_schema(v, field)
    if len(spec.value) > MAX_GRAMMAR_CHARS:
        raise ApiError(f"{field} has {len(spec.value)} characters of JSON, more than the limit of "
                       f"{MAX_GRAMMAR_CHARS}", field)
    return spec


def _choices(v, field: str) -> GrammarSpec:
    if not isinstance(v, list) or not v or len(v) > MAX_CHOICES or not all(isinstance(c, str) and c for c in v):
        raise ApiError(f"{field} must be a list of 1 to {MAX_CHOICES} non-empty strings", field)
    if sum(map(len, v)) > MAX_GRAMMAR_CHARS:
        raise ApiError(f"{field} has more than {MAX_GRAMMAR_CHARS} characters in all", field)
    return GrammarSpec("choice", choices=tuple(dict.fromkeys(v)), param=field)


def _spec(kind: str, v, field: str) -> GrammarSpec | None:
    if kind == "json":
        return _schema(v, field)
    if kind == "choice":
        return _choices(v, field)
    if kind == "json_object":
        if v is not True and v is not False:
            raise ApiError(f"{field} must be a boolean, got {json_typed(v)}", field)
        return GrammarSpec("json_object", param=field) if v else None
    return GrammarSpec(kind, _text(v, field), param=field)


def _response_format(rf) -> GrammarSpec | None:
    if not isinstance(rf, dict):
        raise ApiError(f"response_format must be an object, got {json_typed(rf)}", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", param="response_format")
    if kind != "json_schema":
        raise ApiError(f"response_format.type must be text, json_object or json_schema, got {json_value(kind)}",
                       "response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ApiError("response_format.json_schema must be an object with name and schema",
                       "response_format.json_schema")
    for key in js:
        if key not in JSON_SCHEMA_KEYS:  # a misspelt "schema" gave any JSON object
            raise ApiError(f"response_format.json_schema.{key} is not a field of json_schema (it takes "
                           f"{', '.join(JSON_SCHEMA_KEYS)})", f"response_format.json_schema.{key}")
    name = js.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ApiError("response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -",
                       "response_format.json_schema.name")
    if js.get("strict") not in (None, True, False):
        raise ApiError("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    return _schema(js.get("schema", {"type": "object"}), "response_format.json_schema.schema")


def _tools(tools) -> dict[str, dict]:
    """name → parameters schema of ``tools`` (validated)."""
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise ApiError(f"tools must be a list of 1 to {MAX_TOOLS} function tools", "tools")
    out = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ApiError(f"tools[{i}] must be {{type: 'function', function: {{name, parameters}}}}", f"tools[{i}]")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ApiError(f"tools[{i}].function.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -",
                           f"tools[{i}].function.name")
        if name in out:
            raise ApiError(f"tools[{i}].function.name {name!r} is used twice", f"tools[{i}].function.name")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ApiError(f"tools[{i}].function.parameters must be a JSON schema object",
                           f"tools[{i}].function.parameters")
        if params.get("type", "object") != "object":  # a call's arguments are a JSON object (OpenAI's rule)
            raise ApiError(f"tools[{i}].function.parameters must be a JSON schema of type \"object\" (a call's "
                           f"arguments are an object), got type {json_value(params.get('type'))}",
                           f"tools[{i}].function.parameters")
        out[name] = params
    return out


def _tool_constraint(body: dict, chat: bool) -> tuple[GrammarSpec | None, ToolCalling | None]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):  # OpenAI and vLLM refuse "auto" without tools too
            raise ApiError("tool_choice needs tools (only 'none' may come without them)", "tool_choice")
        return None, None
    if not chat:
        raise ApiError("tools are only supported on /v1/chat/completions", "tools")
    schemas = _tools(tools)
    if choice == "none":
        return None, None
    if choice in (None, "auto"):
        raise ApiError("tool_choice 'auto' (the default with tools) needs a chat template that renders tools and a "
                       "parser of the model's tool-call format, which this model lacks; send tool_choice 'required' "
                       "or {type: 'function', function: {name}}", "tool_choice")
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                  "required": ["name", "parameters"]} for n, p in schemas.items()]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if body.get("parallel_tool_calls") is False:
            schema["maxItems"] = 1
        parts = tuple(_schema(p, f"tools[{i}].function.parameters") for i, p in enumerate(schemas.values()))
        return dataclasses.replace(_schema(schema, "tools"), parts=parts), ToolCalling(None)
    fn = choice.get("function") if isinstance(choice, dict) else None  # may be any JSON value
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError("tool_choice must be none, auto, required or {type: 'function', function: {name}}",
                       "tool_choice")
    if name not in schemas:
        raise ApiError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    i = list(schemas).index(name)
    return _schema(schemas[name], f"tools[{i}].function.parameters"), ToolCalling(name)


def parse_structured(body: dict, chat: bool) -> tuple[GrammarSpec | None, ToolCalling | None]:
    """The output constraint of a request body and, for tool calls, how to report them.

    Raises:
        ApiError: a malformed field, or two constraints at once (naming the field).
    """
    found: list[tuple[str, GrammarSpec]] = []
    rf = body.get("response_format")
    if rf is not None and (spec := _response_format(rf)) is not None:
        found.append(("response_format", spec))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError(f"structured_outputs must be an object, got {json_typed(so)}", "structured_outputs")
        for key in so:
            if key not in SO_KEYS and key not in SO_IGNORED:  # a misspelt key gave unconstrained output
                raise ApiError(f"structured_outputs.{key} is not a field of structured_outputs (it takes "
                               f"{', '.join(SO_KEYS)})", f"structured_outputs.{key}")
        if so.get("structural_tag") is not None:
            raise ApiError("structured_outputs.structural_tag is not supported by llmd",
                           "structured_outputs.structural_tag")
        for key, kind in SO_KEYS.items():
            if so.get(key) is not None and (spec := _spec(kind, so[key], f"structured_outputs.{key}")) is not None:
                found.append((f"structured_outputs.{key}", spec))
    for name in GUIDED:
        if body.get(name) is not None:
            found.append((name, _spec(name.removeprefix("guided_"), body[name], name)))
    tool_spec, calling = _tool_constraint(body, chat)
    if tool_spec is not None:
        found.append(("tool_choice", tool_spec))
    if len(found) > 1:
        raise ApiError(f"{found[1][0]} and {found[0][0]} both constrain the output; send one", found[1][0])
    return (found[0][1] if found else None), calling


def tool_calls(text: str, calling: ToolCalling) -> list[dict] | None:
    """OpenAI ``tool_calls`` from a finished constrained reply, or None when ``text`` is not a
    complete call (a reply cut by ``max_tokens``: it is then returned as ``content``).

    A named function's arguments are the reply itself; ``required`` replies are the JSON array
    ``[{"name", "parameters"}, ...]``, each item one call (arguments re-serialized compactly).
    Each call gets a fresh ``call_`` id (24 hex digits)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if calling.name is not None:
        pairs = [(calling.name, text)]
    elif isinstance(value, list) and value and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                   and "parameters" in c for c in value):
        pairs = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
    else:
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in pairs]


def tool_calls_text(calls, field: str) -> str:
    """An earlier assistant turn's ``tool_calls`` as the text it stands for in the prompt (the
    chat templates here render no tool calls): ``[{"name": ..., "parameters": {...}}]``, the
    ``required`` reply format, so a client can send the conversation back after running a tool.

    Raises:
        ApiError: ``calls`` is not a list of ``{"function": {"name", "arguments"}}`` objects.
    """
    out = []
    for i, c in enumerate(calls if isinstance(calls, list) else [None]):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise ApiError(f"{field}[{i}] must be {{type: 'function', function: {{name, arguments}}}}", f"{field}[{i}]")
        try:
            args = json.loads(f["arguments"])
        except json.JSONDecodeError:
            args = f["arguments"]
        out.append({"name": f["name"], "parameters": args})
    return json.dumps(out, ensure_ascii=False)
