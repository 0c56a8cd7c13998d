"""The report's document model: a list of blocks (heading, paragraph, list, table, image, preformatted), rendered
to Markdown and to one self-contained HTML page (plots embedded as base64 PNG, CSS inline), so both always say
the same thing.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Any


class Doc:
    def __init__(self) -> None:
        self.blocks: list[tuple] = []

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", level, text))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def ul(self, items: list[str]) -> None:
        self.blocks.append(("ul", items))

    def table(
        self, headers: list[str], rows: list[list[Any]], cls: str = "", groups: list[tuple[str, int]] | None = None
    ) -> None:
        """groups: column groups [(label, span), ...] drawn as a header row above the columns in HTML (an
        engine per group in the side-by-side report); a grouped column's header "GROUP: name" shows as "name"
        under it there. Markdown has no such row, so its headers keep the full "GROUP: name"."""
        self.blocks.append(("table", headers, [[str(x) for x in r] for r in rows], cls, groups))

    def img(self, title: str, path: Path) -> None:
        self.blocks.append(("img", title, path))

    def pre(self, text: str) -> None:
        self.blocks.append(("pre", text))

    # -- renderers
    def markdown(self, base: Path) -> str:
        out: list[str] = []
        for b in self.blocks:
            kind = b[0]
            if kind == "h":
                out.append("#" * b[1] + " " + b[2])
            elif kind == "p":
                out.append(b[1])
            elif kind == "ul":
                out.append("\n".join(f"- {x}" for x in b[1]))
            elif kind == "table":
                headers, rows = b[1], b[2]
                esc = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
                lines = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "---|" * len(headers)]
                lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
                out.append("\n".join(lines))
            elif kind == "img":
                out.append(f"![{b[1]}]({b[2].relative_to(base).as_posix()})")
            elif kind == "pre":
                out.append("```\n" + b[1] + "\n```")
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        body: list[str] = []
        for b in self.blocks:
            kind = b[0]
            if kind == "h":
                body.append(f"<h{b[1]}>{_inline(b[2])}</h{b[1]}>")
            elif kind == "p":
                body.append(f"<p>{_inline(b[1])}</p>")
            elif kind == "ul":
                body.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in b[1]) + "</ul>")
            elif kind == "table":
                headers, rows, cls, groups = b[1], b[2], b[3], b[4]
                head = ""
                if groups:
                    head = "<tr>" + "".join(
                        f'<th colspan="{n}" class="group">{_inline(g)}</th>' for g, n in groups
                    ) + "</tr>"
                    headers = [x.split(": ", 1)[1] if g and ": " in x else x for x, g in zip(headers, _spans(groups))]
                th = "".join(f"<th>{_inline(x)}</th>" for x in headers)
                trs = "".join("<tr>" + "".join(f"<td>{_inline(x)}</td>" for x in r) + "</tr>" for r in rows)
                body.append(
                    f'<table class="{cls}"><thead>{head}<tr>{th}</tr></thead><tbody>{trs}</tbody></table>'
                )
            elif kind == "img":
                data = base64.b64encode(b[2].read_bytes()).decode()
                body.append(
                    f'<figure><img alt="{html.escape(b[1])}" src="data:image/png;base64,{data}">'
                    f"<figcaption>{html.escape(b[1])}</figcaption></figure>"
                )
            elif kind == "pre":
                body.append(f"<pre>{html.escape(b[1])}</pre>")
        return HTML_PAGE.format(title=html.escape(title), body="\n".join(body))


def _spans(groups: list[tuple[str, int]]) -> list[str]:
    """The group label of each column, in order."""
    return [g for g, n in groups for _ in range(n)]


def _inline(s: str) -> str:
    s = html.escape(s)
    s = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", s)
    s = re.sub(r"(?<![*\w])\*(\w[^*]*?)\*(?![*\w])", r"<em>\1</em>", s)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", s)


HTML_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; line-height: 1.45; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.88em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.55em; text-align: left; vertical-align: top; }}
th {{ background: #f0f3f7; }}
th.group {{ text-align: center; background: #e3e9f1; }}
tbody tr:nth-child(even) {{ background: #fafafa; }}
table.progression td:nth-child(n+3) {{ text-align: right; white-space: nowrap; }}
table.progression td:last-child {{ text-align: left; white-space: normal; min-width: 14em; }}
table.sidebyside {{ display: block; overflow-x: auto; max-width: 100%; }}
table.sidebyside td:nth-child(n+3) {{ text-align: right; white-space: nowrap; }}
figure {{ display: inline-block; margin: 0.5em 1em 1em 0; }}
img {{ max-width: 560px; border: 1px solid #ddd; }}
pre {{ background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.8em; }}
code {{ background: #f3f3f3; padding: 0 0.2em; }}
</style></head>
<body>
{body}
</body></html>
"""
