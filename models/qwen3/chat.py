"""Qwen3's chat template and its training variant (data/chat.py reaches them through FAMILY.training_chat_templates).

chat_template.jinja is the template of Qwen3's post-trained releases (tokenizer_config.json's chat_template of
Qwen/Qwen3-0.6B ... Qwen/Qwen3-32B), byte for byte: the convention those models were trained in. It renders
earlier turns differently once more follow: only the assistant turns after the last user query get a thinking
block (`<think>\\n...\\n</think>\\n\\n`, empty for the last turn when it has none), so an earlier turn's reasoning
is dropped. A reply therefore cannot be found by rendering the conversation up to it, and
chat_template_training.jinja marks the replies instead: the same template, each assistant turn's output after its
`<|im_start|>assistant\\n` header and through its `<|im_end|>` wrapped in {% generation %} ... {% endgeneration %},
rendering the same text (tests/test_chat.py checks both on the shipped chat corpus and on conversations with
reasoning and tool calls).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
OFFICIAL = (HERE / "chat_template.jinja").read_text(encoding="utf-8")
TRAINING = (HERE / "chat_template_training.jinja").read_text(encoding="utf-8")

TRAINING_CHAT_TEMPLATES = {OFFICIAL: TRAINING}
