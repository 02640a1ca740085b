"""stories260k with a chat template: its tokenizer has none, and the chat routes need one."""

import json
import shutil
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def with_chat_template(model: Path, out: Path) -> Path:
    """A copy of the model folder ``model`` in ``out`` whose tokenizer has ``CHAT_TEMPLATE``."""
    for f in model.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out
