"""Prompts of three kinds for a self-distilled GliDe draft (``glide.self_distill``), as
JSON lines a ``jaxpar-train glide`` run reads with ``data.path=DIR``:

    python bench/glide_prompts.py --target PATH --out DIR [--chat 2000] [--prose 2000] [--code-windows 1]

Each line is one prompt (``{"text": ...}``); the run continues each with the target.
Nothing here is one of ``bench/speculative.py``'s prompts, which it draws from the
*validation* files of the standard library, its own eight questions and the
interpreter's ``LICENSE.txt``:

* ``code.jsonl``: the start of every *training*-split file of the standard library (the
  default corpus), as ``bench/speculative.py``'s code prompts are the start of its
  held-out files; with ``--code-windows N``, also up to ``N - 1`` later windows of each
  (from a line start, every ``--code-chars`` characters) when the start ones are not
  enough;
* ``chat.jsonl``: questions about the standard library's training modules, functions
  and the language reference's topics (a few fixed phrasings each), rendered through
  the target's chat template as ``bench/speculative.py`` renders its chat prompts;
* ``prose.jsonl``: paragraphs of English from the language reference the interpreter
  ships (``pydoc_data.topics``, what ``help()`` shows) and from the docstrings of the
  training modules, their classes and functions.

Deterministic: the same standard library and target give the same files.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import random
import re

from pydoc_data import topics

from jaxpar.train import data as data_lib
from jaxpar.train.config import DataConfig

CHAT_TEMPLATES = (
    "What is the Python module `{module}` for?",
    "Explain in simple terms: {summary}",
    "Show me a short example of using the `{module}` module in Python.",
    "When would I use `{module}` instead of writing the code myself?",
)
FUNCTION_TEMPLATES = (
    "Write a Python function `{name}` that does this: {summary}",
    "What does `{module}.{name}` do in Python?",
    "How do I call `{module}.{name}`? Give an example.",
)
TOPIC_TEMPLATES = (
    "Explain {title} in Python.",
    "Can you give me an example of {title} in Python?",
)
MAX_CHAT_WORDS = 30  # with SmolLM2's system prompt, a rendered question stays under 64 tokens


def _summary(docstring: str | None) -> str | None:
    """A docstring's first sentence, on one line, when it is a plain one."""
    if not docstring:
        return None
    first = " ".join(docstring.strip().split("\n\n")[0].split())
    first = re.split(r"(?<=[.!?])\s", first)[0]
    if not 3 <= len(first.split()) <= MAX_CHAT_WORDS or not first[0].isalpha():
        return None
    return first


def _module_name(name: str) -> str:
    return name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def parsed(docs) -> list[tuple[str, ast.Module]]:
    """``(module name, syntax tree)`` of each document that parses as Python."""
    out = []
    for doc in docs:
        try:
            out.append((_module_name(doc.name), ast.parse(doc.text)))
        except (SyntaxError, ValueError):
            continue
    return out


def questions(modules) -> list[str]:
    """Every question the templates make of the training modules (``parsed``) and the
    reference topics."""
    out = []
    for module, tree in modules:
        if module.startswith(("test.", "idlelib.idle_test")) or "._" in module or module.startswith("_"):
            continue
        summary = _summary(ast.get_docstring(tree))
        if summary:
            out += [t.format(module=module, summary=summary) for t in CHAT_TEMPLATES]
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                summary = _summary(ast.get_docstring(node))
                if summary:
                    out += [t.format(module=module, name=node.name, summary=summary) for t in FUNCTION_TEMPLATES]
    for text in topics.topics.values():
        title = text.strip().splitlines()[0].strip()
        if 2 <= len(title.split()) <= 8:
            out += [t.format(title=title.replace('"', "`")) for t in TOPIC_TEMPLATES]
    return out


def paragraphs(modules, min_words: int = 40) -> list[str]:
    """English paragraphs of the language reference and of the docstrings of the
    modules (``parsed``), classes and functions, on one line each, of at least
    ``min_words`` words and mostly letters."""
    texts = list(topics.topics.values())
    for _, tree in modules:
        texts += [ast.get_docstring(node) or "" for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))]
    out = []
    for text in texts:
        for paragraph in text.split("\n\n"):
            if paragraph.startswith((" ", "\t")):  # an indented block: code or a grammar rule
                continue
            line = " ".join(paragraph.split())
            letters = sum(c.isalpha() or c == " " for c in line)
            if len(line.split()) >= min_words and letters >= 0.85 * len(line):
                out.append(line)
    return out


def code_window(text: str, k: int, chars: int, min_chars: int = 500) -> str | None:
    """A file's ``k``-th window of ``chars`` characters: its start for ``k = 0``, else from
    the first line that starts after ``k * chars`` characters; None when the file has no
    ``min_chars`` left there (the start is always kept)."""
    if k == 0:
        return text[:chars]
    start = text.find("\n", k * chars) + 1
    window = text[start:start + chars] if start > 0 else ""
    return window if len(window) >= min_chars else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=pathlib.Path, required=True,
                        help="the target (its chat template renders the chat prompts)")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--chat", type=int, default=2000, help="chat prompts (at most)")
    parser.add_argument("--prose", type=int, default=2000, help="prose prompts (at most)")
    parser.add_argument("--code-chars", type=int, default=2000, help="characters kept of each file's start")
    parser.add_argument("--code-windows", type=int, default=1,
                        help="code prompts per file: its start, then windows from later lines")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from speculative import chat_renderer  # bench/speculative.py, beside this script

    docs = data_lib.split_documents(DataConfig(), "train")
    render = chat_renderer(args.target)
    # Shuffled once, then the first N: a larger N keeps the smaller one's prompts (and a
    # self-distilled run reuses their rows).
    modules = parsed(docs)
    asked, prose = questions(modules), paragraphs(modules)
    random.Random(args.seed).shuffle(asked)
    random.Random(args.seed).shuffle(prose)
    chat = [render(q) for q in asked[:args.chat]]
    prose = prose[:args.prose]
    code = [window for k in range(args.code_windows) for d in docs
            if (window := code_window(d.text, k, args.code_chars)) is not None]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, texts in (("code", code), ("chat", chat), ("prose", prose)):
        with open(args.out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        print(f"{args.out / name}.jsonl: {len(texts)} prompts")


if __name__ == "__main__":
    main()
