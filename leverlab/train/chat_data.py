"""Chat-formatted examples synthesized from the code itself, so that ChatML prompts get something sensible.

The stdlib has no chat data. From functions that carry a docstring we make two kinds of exchange:
  write:   user "Write a function named X with signature ... . <docstring summary>"  ->  assistant: the source
  explain: user "Explain this function: <source without docstring>"                 ->  assistant: the docstring
The same helpers build the benchmark's chat prompts from held-out files, so prompts and training share a format.
"""

from __future__ import annotations

import ast
import random
import textwrap
from dataclasses import dataclass

from leverlab.train.corpus import SourceFile
from leverlab.train.tokenizer import render_chat


@dataclass(frozen=True, slots=True)
class FunctionInfo:
    rel: str
    name: str
    signature: str  # "def name(args) -> ret:" (first line(s) of the header, dedented)
    source: str  # dedented source, docstring included
    source_no_doc: str  # dedented source without the docstring
    doc: str  # cleaned docstring
    summary: str  # its first paragraph, one line


def iter_functions(f: SourceFile, max_lines: int = 40) -> list[FunctionInfo]:
    try:
        tree = ast.parse(f.text)
    except (SyntaxError, ValueError):
        return []
    lines = f.text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.decorator_list:
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 20 or node.end_lineno is None:
            continue
        start, end = node.lineno - 1, node.end_lineno
        if end - start > max_lines or len(node.body) < 2:
            continue
        doc_node = node.body[0]
        src_lines = lines[start:end]
        try:
            source = textwrap.dedent("".join(src_lines))
            no_doc = textwrap.dedent(
                "".join(lines[start : doc_node.lineno - 1] + lines[doc_node.end_lineno : end])
            )
        except (TypeError, IndexError):
            continue
        header_end = doc_node.lineno - 1 - start  # lines of the header before the docstring
        signature = "".join(
            textwrap.dedent("".join(src_lines[:header_end])).splitlines(keepends=True)
        ).strip()
        if not signature.startswith(("def ", "async def ")) or not signature.endswith(":"):
            continue
        summary = " ".join(doc.split("\n\n")[0].split())
        out.append(
            FunctionInfo(
                f.rel, node.name, signature, source.rstrip() + "\n", no_doc.rstrip() + "\n", doc, summary
            )
        )
    out.sort(key=lambda fi: (fi.rel, fi.name, fi.signature))
    return out


def write_request(fi: FunctionInfo) -> str:
    return f"Write a function named {fi.name} with signature `{fi.signature}`. {fi.summary}"


def explain_request(fi: FunctionInfo) -> str:
    return f"Explain this function:\n```python\n{fi.source_no_doc}```"


def chat_examples(files: list[SourceFile], seed: int = 0, max_examples: int = 3000) -> list[str]:
    """Rendered ChatML conversations (without the trailing end-of-text) from the given files."""
    rng = random.Random(seed)
    funcs = [fi for f in files for fi in iter_functions(f)]
    rng.shuffle(funcs)
    out = []
    for i, fi in enumerate(funcs[:max_examples]):
        if i % 2 == 0:
            msgs = [
                {"role": "user", "content": write_request(fi)},
                {"role": "assistant", "content": f"```python\n{fi.source}```"},
            ]
        else:
            msgs = [
                {"role": "user", "content": explain_request(fi)},
                {"role": "assistant", "content": fi.doc},
            ]
        out.append(render_chat(msgs))
    return out
