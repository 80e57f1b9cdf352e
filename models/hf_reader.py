"""What every family reads alike from a transformers config.json (models/<family>/hf.py adds its own fields): the
decoder's shape, the attention's heads, the norm's epsilon, the context length, tied embeddings, the RoPE rule and
the settings no family's model computes (a bias, dropout, another activation, sliding windows), each refused on a
line of one ConfigError that names the file and the key.

Its own module, next to models/hf.py rather than in it: the family folders import it, and models/hf.py imports
the package that looks the families up (models/__init__.py), which would close a loop of imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from errors import ConfigError

SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")  # every family's, required


@dataclass(frozen=True)
class HFDefaults:
    """The defaults of a family's transformers config class, which a config.json that omits the key gets."""

    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0  # transformers' default_theta (published configs set their own)
    tie_word_embeddings: bool = False
    num_key_value_heads: int | None = None  # None (absent or null in the file): multi-head, num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads, as transformers' attention divides


def positive_int(value: Any) -> bool:
    """Whether a config.json value is a positive integer (JSON's true and false are no sizes)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class HFConfigReader:
    """One config.json's contents (`cfg`, from the file `source`) read into the fields every family's ModelArgs
    has (`args()`, plus `head_dim`), with what it cannot represent collected in `problems`.

    The shape (SHAPE_KEYS and the family's `sizes`, head_dim, num_key_value_heads) is checked first and refused at
    once, since every other check needs it; the rest is collected, with the family's own refusals (`refuse`,
    `positive`), until the family calls `check()`. RoPE: transformers < 5 writes rope_theta + rope_scaling,
    transformers 5 one rope_parameters dict; `rope` is that dict ({} without scaling) and `rope_type` its type,
    refused unless in `rope_types` (the family reads the parameters of a scaling it implements)."""

    def __init__(
        self,
        cfg: dict[str, Any],
        *,
        source: str,
        defaults: HFDefaults,
        sizes: tuple[str, ...] = ("intermediate_size",),
        rope_types: tuple[str, ...] = ("default",),
    ):
        self.cfg, self.source, self.defaults = cfg, source, defaults
        self.problems: list[str] = []
        for key in (*SHAPE_KEYS, *sizes):
            self.positive(key, cfg.get(key))
        self.n_heads: int = cfg.get("num_attention_heads")  # type: ignore[assignment]
        kv_heads = cfg.get("num_key_value_heads", defaults.num_key_value_heads)
        head_dim = cfg.get("head_dim", defaults.head_dim)
        if self.problems:  # head_dim and the heads below need the shape
            self.check()
        self.n_kv_heads: int = self.n_heads if kv_heads is None else kv_heads
        self.head_dim: int = cfg["hidden_size"] // self.n_heads if head_dim is None else head_dim
        self.positive("num_key_value_heads", self.n_kv_heads)
        self.positive("head_dim", self.head_dim)
        self.check()

        if self.n_heads % self.n_kv_heads:
            self.problem(
                f"num_key_value_heads = {self.n_kv_heads} does not divide num_attention_heads = {self.n_heads}"
            )
        if self.head_dim % 2:
            self.problem(f"head_dim = {self.head_dim} is odd; RoPE rotates pairs of dimensions")
        if cfg.get("hidden_act", "silu") != "silu":
            self.refuse("hidden_act", "is not supported; the model's MLP is SwiGLU (silu)")
        if cfg.get("attention_bias"):
            self.refuse("attention_bias", "is not supported; the model's projections have no bias")
        if cfg.get("attention_dropout", 0.0):
            self.refuse("attention_dropout", "is not supported; the model has no dropout (set it to 0.0)")
        if cfg.get("use_sliding_window"):
            self.refuse(
                "use_sliding_window", "is not supported; the model attends to the whole causal window (set it to false)"
            )
        if any(t != "full_attention" for t in cfg.get("layer_types") or ()):
            kinds = sorted(set(cfg["layer_types"]) - {"full_attention"})
            self.problem(f"layer_types has {kinds}; the model implements full_attention layers only")

        self.rope: dict[str, Any] = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        self.rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        self.rope_theta = float(self.rope.get("rope_theta", cfg.get("rope_theta", defaults.rope_theta)))
        self.rope_type: str = self.rope.get("rope_type", self.rope.get("type", "default"))
        if self.rope_type not in rope_types:
            scalings = "".join(f" or {t!r} scaling" for t in rope_types if t != "default")
            self.problem(
                f"{self.rope_key}.rope_type = {self.rope_type!r} is not supported; the model implements RoPE without "
                f"scaling{scalings}"
            )

    def problem(self, text: str) -> None:
        """A line of the ConfigError `check` raises, prefixed with the file."""
        self.problems.append(f"{self.source}: {text}")

    def refuse(self, key: str, why: str) -> None:
        """Refuse the file's value of `key`: `why` says what the model does instead, or the fix."""
        self.problem(f"{key} = {self.cfg.get(key)!r} {why}")

    def positive(self, key: str, value: Any) -> bool:
        """Whether `value` (the file's `key`, or its default) is a positive integer; refused when not."""
        if not positive_int(value):
            self.problem(f"{key} = {value!r} must be a positive integer")
            return False
        return True

    def check(self) -> None:
        """Raise every problem found so far, one ConfigError."""
        if self.problems:
            raise ConfigError(*self.problems)

    def args(self) -> dict[str, Any]:
        """The ModelArgs fields every family has, by their names there (head_dim is `self.head_dim`: Llama's
        ModelArgs derives it)."""
        cfg, d = self.cfg, self.defaults
        return dict(
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            vocab_size=cfg["vocab_size"],
            norm_eps=float(cfg.get("rms_norm_eps", d.rms_norm_eps)),
            rope_theta=self.rope_theta,
            max_seq_len=int(cfg.get("max_position_embeddings", d.max_position_embeddings)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", d.tie_word_embeddings)),
        )
