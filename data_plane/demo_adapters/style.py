"""What each demo adapter's style looks like in an answer, and greedy answers through the engine.

The checks are deliberately loose about content and strict about form: a pirate answer says
"ahoy" or "arr", a shouty answer is at least 80 % upper-case letters, a signoff answer ends with
"Fleet Bot". The base model does none of these.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir

# Questions in none of data/*.jsonl: the adapters must generalise to them.
HELD_OUT = (
    "What is the tallest mountain?",
    "How do I boil an egg?",
    "What should I eat for breakfast?",
    "How can I sleep better?",
)
_PIRATE = re.compile(r"\b(ahoy|arr+)\b", re.IGNORECASE)


def upper_share(text: str) -> float:
    """The fraction of the letters in ``text`` that are upper case (0 for no letters)."""
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def shows_style(name: str, text: str) -> bool:
    """Whether ``text`` has the style of the demo adapter ``name``."""
    if name == "pirate":
        return _PIRATE.search(text) is not None
    if name == "shouty":
        return upper_share(text) >= 0.8
    if name == "signoff":
        return text.rstrip().endswith("Fleet Bot")
    raise ValueError(f"unknown demo adapter {name!r}; the demo adapters are {', '.join(DEMO_ADAPTERS)}")


async def greedy_answers(questions: tuple[str, ...], adapters: tuple[str | None, ...], max_tokens: int = 64,
                         adapter_root: Path | None = None, model: Path | None = None) -> dict[str | None, list[str]]:
    """Greedy answers to every question under every adapter (None = the base model), all requests
    in flight at once through one float32 CPU engine on ``model`` (default: the demo model).
    Adapters are read from ``adapter_root`` (default: the committed demo adapters)."""
    from data_plane.engine.sequence import SamplingParams
    from data_plane.local import local_engine, prompt_ids

    root = adapter_root or demo_adapter_dir(DEMO_ADAPTERS[0]).parent
    named = sum(a is not None for a in adapters)
    params = SamplingParams(max_tokens=max_tokens)
    async with local_engine(model, (root,), max_num_seqs=len(questions) * len(adapters),
                            max_loras=max(1, named)) as engine:

        async def answer(adapter: str | None, question: str) -> str:
            return "".join([out.text async for out in engine.generate(prompt_ids(engine, question), params, adapter)])

        texts = await asyncio.gather(*(answer(a, q) for a in adapters for q in questions))
    n = len(questions)
    return {a: [t.strip() for t in texts[i * n : (i + 1) * n]] for i, a in enumerate(adapters)}
