"""What a rotary embedding looks like in a given model, read from the live model."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Literal

Layout = Literal["half", "interleaved"]
Channels = Literal["leading", "trailing"]


@dataclass(frozen=True)
class RotaryGeometry:
    """The facts every scaling method needs.

    rotary_dim: D, the number of rotated channels of each head (head_dim * partial factor).
    base: the trained RoPE base b (theta_i = b^(-2i/D)).
    original_window: L, the window the model was trained with; factors are relative to it.
    layout: how pairs are formed: "half" pairs channel i with i + D/2 (LLaMA's rotate_half),
        "interleaved" pairs 2i with 2i+1 (GLM, ChatGLM).
    head_dim: the full head size; channels outside the rotated ones pass through unrotated.
    channels: which rotary_dim channels of a head rotate: "leading" (the first, partial rotary),
        or "trailing" (the last: multi-head latent attention, DeepSeek-V2/V3 and their kin).
    """

    rotary_dim: int
    base: float
    original_window: int
    layout: Layout = "half"
    head_dim: int | None = None
    channels: Channels = "leading"

    def __post_init__(self):
        if self.rotary_dim < 4 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and >= 4, got {self.rotary_dim}")
        if not self.base > 1:
            raise ValueError(f"RoPE base must be > 1, got {self.base}")
        if self.original_window < 1:
            raise ValueError(f"original window must be >= 1, got {self.original_window}")
        if self.layout not in ("half", "interleaved"):
            raise ValueError(f"layout must be 'half' or 'interleaved', got {self.layout!r}")
        if self.channels not in ("leading", "trailing"):
            raise ValueError(f"channels must be 'leading' or 'trailing', got {self.channels!r}")
        if self.head_dim is not None and self.head_dim < self.rotary_dim:
            raise ValueError(f"head_dim {self.head_dim} < rotary_dim {self.rotary_dim}")

    @cached_property
    def pairing(self) -> tuple[str, str]:
        """(layout, channels): what `rope_ext.rotation.apply_rotary` takes after (cos, sin). Kept on
        first use (not a field: records and equality stay the fields'): attention reads it in every
        layer as a plain attribute, without a call."""
        return self.layout, self.channels

    def to_dict(self) -> dict:
        values = asdict(self)
        if self.channels == "leading":  # the default: records of such models read as they always have
            del values["channels"]
        return values
