"""The texts the compression benchmarks measure on: four kinds, none of which the codecs were tuned to.

  prose      Jane Austen, Emma, chapter I (public domain; bench/texts/, from Debian's r-cran-janeaustenr)
  dialogue   the spoken lines of Pride and Prejudice's first chapters, alternating user and assistant
             turns in ChatML (public domain; bench/texts/)
  code       Python source: the standard library's argparse.py, read from this Python install
  docs       technical documentation: pydoc's topic pages (the language reference), from the middle of
             the sorted list (the first pages are `tiered-kv quality`'s old default text)

`load(name)` gives one text; `NAMES` lists them. Each holds more than 2,048 tokens of SmolLM2's and of
Gemma 3's tokenizer.
"""

from __future__ import annotations

import inspect
from pathlib import Path

NAMES = ("prose", "dialogue", "code", "docs")
_HERE = Path(__file__).resolve().parent / "texts"


def load(name: str) -> str:
    if name == "prose":
        return (_HERE / "prose_austen_emma.txt").read_text()
    if name == "dialogue":
        return (_HERE / "dialogue_austen_pride.txt").read_text()
    if name == "code":
        import argparse

        source = inspect.getsource(argparse)
        return source[source.find("class _AttributeHolder"):]
    if name == "docs":
        from pydoc_data.topics import topics

        names = sorted(topics)
        return "\n\n".join(topics[n] for n in names[len(names) // 2:])
    if Path(name).is_file():
        return Path(name).read_text()
    raise ValueError(f"text {name!r}: allowed {', '.join(NAMES)} or a file path")
