"""index.html: one self-contained page linking every figure and table of a report, readable offline.

Only relative links and inline CSS (no scripts, fonts or CDNs); images are embedded with ``<img>`` so a
browser (or the headless-Chromium test) can check that each one loads.
"""
from __future__ import annotations

import html
from pathlib import Path

from fxquant.analysis.outputs import Entry

_CSS = """body{font-family:sans-serif;margin:1.5em;max-width:1400px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;margin-top:1.5em}
figure{display:inline-block;margin:.5em;vertical-align:top;max-width:48%}figure img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:.85em;color:#444}pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:.8em;max-height:30em}
ul{font-size:.9em}.problems{color:#a00}"""


def write(root: Path, entries: list[Entry], title: str, facts: list[tuple[str, str]], problems: list[str],
          inline_text_limit: int = 20000) -> Path:
    sections: dict[str, list[Entry]] = {}
    for e in entries:
        sections.setdefault(e.section, []).append(e)
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1><ul>"]
    parts += [f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in facts]
    parts.append("</ul>")
    if problems:
        parts.append("<h2>Problems</h2><ul class='problems'>")
        parts += [f"<li>{html.escape(p)}</li>" for p in problems]
        parts.append("</ul>")
    parts.append("<h2>Contents</h2><ul>")
    parts += [f"<li><a href='#s{i}'>{html.escape(s)}</a> ({len(es)} files)</li>" for i, (s, es) in enumerate(sections.items())]
    parts.append("</ul>")
    for i, (sec, es) in enumerate(sections.items()):
        parts.append(f"<h2 id='s{i}'>{html.escape(sec)}</h2>")
        links = [e for e in es if e.kind != "figure"]
        if links:
            parts.append("<ul>")
            parts += [f"<li><a href='{html.escape(e.path)}'>{html.escape(e.title)}</a> ({html.escape(e.path)})</li>"
                      for e in links]
            parts.append("</ul>")
        for e in es:
            if e.kind == "table":
                text = (root / e.path).read_text()
                if len(text) <= inline_text_limit:
                    parts.append(f"<details><summary>{html.escape(e.title)}</summary><pre>{html.escape(text)}</pre></details>")
        for e in es:
            if e.kind == "figure":
                src = html.escape(e.path)
                parts.append(f"<figure><a href='{src}'><img src='{src}' alt='{html.escape(e.title)}'></a>"
                             f"<figcaption>{html.escape(e.title)}</figcaption></figure>")
    parts.append("</body></html>\n")
    path = root / "index.html"
    path.write_text("\n".join(parts))
    return path
