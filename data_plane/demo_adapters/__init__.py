"""Three small LoRA adapters of the demo model, trained here and committed with the repository.

Each lives in ``data_plane/demo_adapters/<name>/`` as a standard PEFT directory
(``adapter_config.json`` + ``adapter_model.safetensors``, bfloat16). ``train.py`` rebuilds them
from the hand-written examples in ``data/<name>.jsonl``:

- ``pirate``: answers wrapped "Ahoy matey! ... arr!" in pirate voice (r=8 on q, k, v, o);
- ``shouty``: answers in ALL CAPS (r=4 on all seven projections);
- ``signoff``: short answers ending with the line "— Fleet Bot" (r=8, alpha 16, rsLoRA, down_proj at r=4).
"""

from __future__ import annotations

from pathlib import Path

DEMO_ADAPTERS = ("pirate", "shouty", "signoff")

_HERE = Path(__file__).resolve().parent


def demo_adapter_dir(name: str) -> Path:
    """The committed PEFT directory of the demo adapter ``name``."""
    if name not in DEMO_ADAPTERS:
        raise ValueError(f"unknown demo adapter {name!r}; the demo adapters are {', '.join(DEMO_ADAPTERS)}")
    return _HERE / name
