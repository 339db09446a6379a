"""The API docs page at `/schema`: the OpenAPI document rendered as one self-contained HTML page.

Litestar's render plugins (Swagger UI, ReDoc, RapiDoc, Scalar, Stoplight Elements) load their JavaScript and
CSS from public CDNs when the page opens, which an offline deployment cannot reach and which sends every
reader of the docs to a third party. This page is rendered on the server from the same document that
`/schema/openapi.json` serves: no script, no external asset. Its sections: the security scheme, then per tag
each operation (parameters, request body, answers with their schemas and examples), then every schema.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

from litestar import Request
from litestar.openapi.plugins import OpenAPIRenderPlugin

_METHODS: Final = ("get", "put", "post", "patch", "delete")
_REF: Final = "#/components/schemas/"
_STYLE: Final = """<style>
body { font: 15px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 72rem; padding: 0 1rem;
  color: #1b1f24 }
code, pre { font: 13px/1.4 ui-monospace, monospace }
pre { background: #f4f5f7; padding: .6rem; overflow: auto }
details { border: 1px solid #d8dce1; border-radius: 4px; margin: .4rem 0; padding: .3rem .6rem }
summary { cursor: pointer }
.m { display: inline-block; width: 4.2rem; font-weight: 600; text-transform: uppercase }
table { border-collapse: collapse; margin: .4rem 0 }
td, th { border: 1px solid #d8dce1; padding: .2rem .5rem; text-align: left; vertical-align: top }
.d { white-space: pre-wrap }
</style>"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _json(value: Any) -> str:
    return f"<pre>{_e(json.dumps(value, indent=2, ensure_ascii=False))}</pre>"


def _type(schema: Mapping[str, Any]) -> str:
    """A short, linked name of a schema: a component's name, `array of X`, `X | null`, or its JSON."""
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith(_REF):
        name = ref[len(_REF) :]
        return f'<a href="#schema-{_e(name)}"><code>{_e(name)}</code></a>'
    for combinator in ("allOf", "oneOf", "anyOf"):
        parts = schema.get(combinator)
        if isinstance(parts, list) and all(isinstance(p, Mapping) for p in parts):
            glue = " &amp; " if combinator == "allOf" else " | "
            return glue.join(_type(p) for p in parts)
    items = schema.get("items")
    if schema.get("type") == "array" and isinstance(items, Mapping):
        return f"array of {_type(items)}"
    if set(schema) <= {"type", "description"}:
        kind = schema.get("type", "any")
        return f"<code>{_e(' | '.join(kind) if isinstance(kind, list) else kind)}</code>"
    return f"<code>{_e(json.dumps(schema, ensure_ascii=False))}</code>"


def _content(content: Mapping[str, Any]) -> Iterator[str]:
    for media_type, media in content.items():
        schema = media.get("schema") or {}
        yield f"<p><code>{_e(media_type)}</code>: {_type(schema)}</p>"
        if schema.get("description"):
            yield f'<p class="d">{_e(schema["description"])}</p>'
        examples = list((media.get("examples") or {}).values())
        examples += [{"value": e} for e in schema.get("examples") or []]
        if "example" in media:
            examples.append({"value": media["example"]})
        for example in examples:
            value = example.get("value")
            yield f"<pre>{_e(value)}</pre>" if isinstance(value, str) else _json(value)


def _parameters(parameters: list[Mapping[str, Any]]) -> Iterator[str]:
    yield "<table><tr><th>parameter</th><th>in</th><th>type</th><th>required</th><th>description</th></tr>"
    for p in parameters:
        yield (
            f"<tr><td><code>{_e(p['name'])}</code></td><td>{_e(p['in'])}</td>"
            f"<td>{_type(p.get('schema') or {})}</td><td>{'yes' if p.get('required') else 'no'}</td>"
            f'<td class="d">{_e(p.get("description", ""))}</td></tr>'
        )
    yield "</table>"


def _operation(method: str, path: str, op: Mapping[str, Any], schemes: list[str]) -> Iterator[str]:
    anchor = _e(op.get("operationId", f"{method}-{path}"))
    yield f'<details id="op-{anchor}"><summary><span class="m">{_e(method)}</span> <code>{_e(path)}</code>'
    yield f" {_e(op.get('summary', ''))}</summary>"
    if op.get("description"):
        yield f'<p class="d">{_e(op["description"])}</p>'
    security = [name for requirement in op.get("security") or [] for name in requirement]
    key = ", ".join(f"<code>{_e(s)}</code>" for s in security) if security else "none"
    yield f"<p>Key: {key}</p>" if schemes else ""
    if op.get("parameters"):
        yield from _parameters(op["parameters"])
    body = op.get("requestBody")
    if body:
        yield "<h4>Request body</h4>"
        yield from _content(body.get("content") or {})
    yield "<h4>Answers</h4>"
    for status, response in (op.get("responses") or {}).items():
        yield f'<p><b>{_e(status)}</b> <span class="d">{_e(response.get("description", ""))}</span></p>'
        yield from _content(response.get("content") or {})
    yield "</details>"


def _operations(document: Mapping[str, Any]) -> Iterator[tuple[str, str, str, Mapping[str, Any]]]:
    """(tag, method, path, operation) for every operation, in path order."""
    for path, item in sorted((document.get("paths") or {}).items()):
        for method in _METHODS:
            op = item.get(method)
            if op is not None:
                yield (op.get("tags") or ["other"])[0], method, path, op


def render_page(document: Mapping[str, Any], json_url: str) -> str:
    """The docs page of `document`, linking to the JSON document at `json_url`."""
    info = document.get("info") or {}
    title = f"{info.get('title', 'API')} {info.get('version', '')}".strip()
    schemes = (document.get("components") or {}).get("securitySchemes") or {}
    out = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title>{_STYLE}</head>",
        f"<body><h1>{_e(title)}</h1>",
        f'<p class="d">{_e(info.get("description", ""))}</p>',
        f"<p>OpenAPI {_e(document.get('openapi', ''))} document: ",
        f'<a href="{_e(json_url)}">{_e(json_url)}</a></p>',
    ]
    if schemes:
        out.append("<h2>Security</h2>")
        out.extend(
            f"<p><code>{_e(name)}</code>: {_e(s.get('type', ''))} {_e(s.get('scheme', ''))}. "
            f"{_e(s.get('description', ''))}</p>"
            for name, s in schemes.items()
        )
    operations = list(_operations(document))
    tags = [(t["name"], t.get("description", "")) for t in document.get("tags") or []]
    known = {name for name, _ in tags}
    tags += [(t, "") for t in dict.fromkeys(tag for tag, *_ in operations) if t not in known]
    for tag, description in tags:
        mine = [(method, path, op) for t, method, path, op in operations if t == tag]
        if mine:
            out.append(f"<h2>{_e(tag)}</h2><p>{_e(description)}</p>")
            for method, path, op in mine:
                out.extend(_operation(method, path, op, list(schemes)))
    out.append("<h2>Schemas</h2>")
    for name, schema in ((document.get("components") or {}).get("schemas") or {}).items():
        out.append(f'<details id="schema-{_e(name)}"><summary><code>{_e(name)}</code></summary>')
        out.append(_json(schema))
        out.append("</details>")
    out.append("</body></html>")
    return "".join(out)


class DocsPagePlugin(OpenAPIRenderPlugin):
    """Serves `render_page` of the app's document (by default at the schema path's root)."""

    def __init__(self, path: str = "/") -> None:
        # No favicon: Litestar's default one is fetched from a CDN.
        super().__init__(path=path, favicon="")

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        """The page, rendered from the document this app serves."""
        return render_page(openapi_schema, self.get_openapi_json_route(request)).encode()
