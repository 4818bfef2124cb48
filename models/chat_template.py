"""Chat templates rendered exactly as ``transformers`` renders them, without importing transformers.

Source: transformers 5.x ``utils/chat_template_utils.py`` (``_cached_compile_jinja_template``,
``render_jinja_template``) and ``PreTrainedTokenizerBase.apply_chat_template``: a jinja2
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
``loopcontrols`` extension and a ``{% generation %}`` tag (rendered as its body), the filter
``tojson`` (``json.dumps`` with ``ensure_ascii=False``), the globals ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace`` (underscore names refused), and the render call
``template.render(messages=..., tools=None, documents=None, add_generation_prompt=...,
**special_tokens_map)``. Messages are normalized as transformers does for plain data: keys whose
value is None dropped, ``reasoning_content`` / ``thinking`` filled from each other or from
``reasoning``. Importing transformers costs ~0.5 s of a warm start; this module needs jinja2 only
(tested equal to transformers' ``apply_chat_template(tokenize=False)`` in
``tests/models/test_fast_tokenizer.py``).

Raises ``jinja2.TemplateError`` (a template's ``raise_exception``, or a syntax error), as
transformers does.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

#: jinja2 releases before 3.1.6 have known sandbox escapes (transformers refuses them too)
MIN_JINJA2 = (3, 1, 6)
#: names a message's reasoning goes by; the first is the one templates read (transformers' order)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


@lru_cache(maxsize=8)
def compile_template(source: str):
    """The compiled ``jinja2.Template`` of a chat template (cached per source text).

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
        ImportError: jinja2 older than 3.1.6.
    """
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if _version(jinja2.__version__) < MIN_JINJA2:
        raise ImportError(f"chat templates need jinja2>=3.1.6 (sandbox fixes), found {jinja2.__version__}")

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: its body (transformers tracks assistant
        spans there only for ``return_assistant_tokens_mask``)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        """``dict(...)`` and ``dict.fromkeys(...)`` without the type's attributes."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja2's ``namespace`` refusing underscore-prefixed attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(source)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Copies of ``messages`` without None-valued keys, with the reasoning fields aliased
    (transformers' ``_normalize_chat_messages`` and ``_alias_reasoning_fields`` on plain dicts)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat(source: str, messages: list[dict], special_tokens: dict[str, str],
                add_generation_prompt: bool = False) -> str:
    """The text of ``messages`` (``[{"role", "content"}, ...]``, plain JSON data) under the chat
    template ``source``, with the tokenizer's named special tokens (``bos_token``, ...) as
    template variables. Raises ``jinja2.TemplateError``; ValueError for no messages."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    return compile_template(source).render(messages=normalize_messages(messages), tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt, **special_tokens)
