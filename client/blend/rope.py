"""Rotary re-encoding: move a cached K from the positions it was computed at to new ones.

Why this file exists: a document's KV is stored once, computed from position 0, and
blended into prompts where it starts at some offset p. Its K carries RoPE at its old
positions. Each frequency pair of RoPE is a 2-D rotation by `position * inv_freq`, and
rotations compose, so R(new) R(old)^-1 = R(new - old): rotating the stored K by the
per-token delta `new - old` equals computing it at `new`, in one pass (LMCache's blending
removes RoPE and re-applies it, two passes per layer). V carries no position.

The angles come from the model's own `inv_freq` (the model's `rotary_emb` buffer), so
rope_theta and Llama 3 scaling are exactly what the model uses; RoPE variants whose
rotation is not a pure function of the position delta are refused (LMCache issues #242
and PR #2946 show what happens when they are not: garbled output on Llama 3.1).

Convention: transformers' Llama `rotate_half`, the half-split (GPT-NeoX) layout: the
pairs are (x[i], x[i + head_dim/2]), not interleaved. Rotation runs in fp32 with the
angles in float64 (float32 where the device has no float64), then is cast back to the
input's dtype; the per-token cos/sin tables of the last delta tensor are kept, so that
the layers of one blended batch compute them once.

This module does not import transformers: `from_model` only reads attributes.
"""

import dataclasses
import math

import torch

# RoPE types whose inv_freq is fixed, with no scaling of cos/sin: rotating by a position
# delta is exact for these. ("linear" divides inv_freq by a factor; "llama3" rescales
# each frequency once; both still rotate by position * inv_freq.)
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_REFUSED_WHY = {
    "dynamic": "its inv_freq changes with the sequence length",
    "longrope": "its inv_freq changes with the sequence length and it scales cos/sin",
    "yarn": "it scales cos/sin by an attention factor, so rotating twice scales twice",
}


class LlamaRotary:
    """RoPE of a Llama-family model, applied as a rotation by per-token position deltas.

    After transformers' `LlamaRotaryEmbedding` + `apply_rotary_pos_emb` (half-split
    `rotate_half`), without their cos/sin cast to the model dtype: this rotates in fp32.

    Attributes:
        inv_freq: float32 `[head_dim // 2]`, CPU: the inverse frequency of each pair.
        head_dim: the rotated width (2 * len(inv_freq)).
    """

    def __init__(self, inv_freq: torch.Tensor):
        """Args:
            inv_freq: float `[head_dim // 2]`, the model's inverse frequencies.

        Raises:
            TypeError: inv_freq is not a floating-point tensor.
            ValueError: inv_freq is not 1-D and non-empty, or not finite.
        """
        if not isinstance(inv_freq, torch.Tensor) or not inv_freq.is_floating_point():
            raise TypeError("inv_freq must be a floating-point torch.Tensor, e.g. "
                            "model.model.rotary_emb.inv_freq")
        if inv_freq.dim() != 1 or inv_freq.numel() == 0:
            raise ValueError("inv_freq must be 1-D [head_dim // 2], "
                             f"got shape {tuple(inv_freq.shape)}")
        if not torch.isfinite(inv_freq).all():
            raise ValueError("inv_freq has non-finite values")
        # float32 [head_dim // 2], cpu: a copy, as the model's forward uses it (.float()).
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32).clone()
        self.head_dim = 2 * self.inv_freq.numel()
        # (delta tensor, a copy of it, device, cos, sin) of the last `rotate`.
        self._last_tables: tuple | None = None

    @classmethod
    def from_params(cls, head_dim: int, rope_theta: float,
                    rope_scaling: dict | None = None) -> "LlamaRotary":
        """RoPE from its parameters, as a Llama config holds them (for tests and tools).

        Args:
            head_dim: width of one attention head (even).
            rope_theta: the RoPE base (10000 for Llama 2, 500000 for Llama 3).
            rope_scaling: None (or rope_type "default"), {"rope_type": "linear",
                "factor"}, or Llama 3's {"rope_type": "llama3", "factor",
                "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
                (the legacy key "type" is accepted for "rope_type").

        Raises:
            ValueError: odd head_dim, theta <= 1, a missing key, or a refused rope type.
        """
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
        if not rope_theta > 1:
            raise ValueError(f"rope_theta must be > 1, got {rope_theta!r}")
        # Same arithmetic as the model's default init, so the buffers agree (float32).
        inv_freq = 1.0 / (float(rope_theta) ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        scaling = dict(rope_scaling or {})
        rope_type = _check_rope_type(scaling.get("rope_type", scaling.get("type", "default")))
        try:
            if rope_type == "linear":
                inv_freq = inv_freq / float(scaling["factor"])
            elif rope_type == "llama3":
                inv_freq = _llama3_inv_freq(
                    inv_freq, float(scaling["factor"]), float(scaling["low_freq_factor"]),
                    float(scaling["high_freq_factor"]),
                    float(scaling["original_max_position_embeddings"]))
        except KeyError as missing:
            raise ValueError(f"rope_scaling of type {rope_type!r} needs the key {missing}"
                             ) from None
        return cls(inv_freq)

    @classmethod
    def from_config(cls, config) -> "LlamaRotary":
        """The RoPE a Llama-family model's config describes (`rope_settings`), computed
        as the model's default init does (`from_params`): vLLM's blend worker, which
        has the config, not transformers' rotary module.

        Raises:
            ValueError: as `rope_settings`.
        """
        settings = rope_settings(config)
        return cls.from_params(settings.head_dim, settings.rope_theta, settings.rope_scaling)

    @classmethod
    def from_model(cls, model) -> "LlamaRotary":
        """The RoPE a transformers Llama-family model uses, read from the model itself.

        Reads `model.model.rotary_emb` (or `model.rotary_emb` for a bare decoder): its
        `inv_freq` buffer and `attention_scaling`; the settings come from
        `rope_settings(model.config)`, the reader `from_config` uses too. A model cast
        to bf16 also casts `inv_freq`; its forward then uses the cast values as float32,
        and so does this.

        Raises:
            ValueError: the rope type is dynamic, longrope, yarn or unknown; the
                attention scaling is not 1; the rotary is partial; per-layer-type RoPE;
                the model has no `rotary_emb` (the message says which).
        """
        inner = getattr(model, "model", model)
        rotary = getattr(inner, "rotary_emb", None)
        inv_freq = getattr(rotary, "inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor):
            raise ValueError(f"{type(model).__name__} has no model.rotary_emb.inv_freq: "
                             "only Llama-family models with one shared RoPE are supported")
        settings = rope_settings(model.config)
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        if scaling != 1.0:
            raise ValueError(f"attention_scaling is {scaling}, not 1: cos/sin are scaled, so a "
                             "re-rotation would scale K twice; unsupported")
        if 2 * inv_freq.numel() != settings.head_dim:
            raise ValueError(f"partial rotary ({2 * inv_freq.numel()} of {settings.head_dim} "
                             "dims rotated) is not supported")
        return cls(inv_freq)

    def rotate(self, x: torch.Tensor, delta_positions: torch.Tensor,
               token_dim: int) -> torch.Tensor:
        """Rotate `x` by a per-token position delta (RoPE at `delta`, composed with x's).

        Args:
            x: Q or K, any float dtype and device; the last axis is `head_dim` or a
                multiple of it (heads flattened, `[..., num_heads * head_dim]`).
            delta_positions: integer (or float) `[x.shape[token_dim]]`, any device:
                positions to move each token by (new - old; negative moves back).
            token_dim: the token axis of x (not the last axis).

        Returns:
            A new tensor, x's shape, dtype and device.

        Raises:
            ValueError: the last axis is not a multiple of head_dim, token_dim is the
                last axis or out of range, or the delta length differs from the tokens.
        """
        ndim = x.dim()
        if not -ndim <= token_dim < ndim or token_dim % ndim == ndim - 1:
            raise ValueError(f"token_dim {token_dim} must name an axis of x (shape "
                             f"{tuple(x.shape)}) other than the last (head_dim) axis")
        token_dim %= ndim
        width = x.shape[-1]
        if width % self.head_dim:
            raise ValueError(f"x's last axis ({width}) must be head_dim ({self.head_dim}) or a "
                             "multiple of it")
        if delta_positions.dim() != 1 or delta_positions.numel() != x.shape[token_dim]:
            raise ValueError(f"delta_positions must be 1-D with {x.shape[token_dim]} entries "
                             f"(x's token axis {token_dim}), "
                             f"got shape {tuple(delta_positions.shape)}")
        xr = x.reshape(*x.shape[:-1], width // self.head_dim, self.head_dim)
        cos, sin = self._tables(delta_positions, x.device)
        half = self.head_dim // 2
        shape = [1] * xr.dim()
        shape[token_dim] = delta_positions.numel()
        shape[-1] = self.head_dim
        half_shape = shape[:-1] + [half]
        cos, sin = cos.view(shape), sin.view(half_shape)
        x32 = xr.to(torch.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): three passes.
        out = x32 * cos
        out[..., :half].addcmul_(x32[..., half:], sin, value=-1)
        out[..., half:].addcmul_(x32[..., :half], sin)
        return out.to(x.dtype).reshape(x.shape)

    def _tables(self, delta_positions: torch.Tensor,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos `[T, head_dim]` and sin `[T, head_dim // 2]` of each token's delta,
        on `device`. The last call's tables are reused when given the same, unmodified
        tensor again (a blend executor passes one tensor to every layer of a batch).

        The angles are computed once per distinct delta (blended segments move all their
        tokens by one delta; float64 cos and sin are slow), in float64 (float32 where the
        device has no float64), then gathered per token.
        """
        last = self._last_tables
        if (last is not None and last[0] is delta_positions and last[2] == device
                and torch.equal(delta_positions, last[1])):  # inference tensors: no _version
            return last[3], last[4]
        exact = torch.float64 if device.type in ("cpu", "cuda") else torch.float32
        deltas, token_delta = torch.unique(delta_positions.to(device), return_inverse=True)
        # [num_deltas, head_dim // 2]: the angle of each pair, for each delta.
        angles = deltas.to(exact)[:, None] * self.inv_freq.to(device, exact)[None, :]
        cos = angles.cos().to(torch.float32)
        cos = torch.cat((cos, cos), dim=-1)[token_delta]  # [T, head_dim]
        sin = angles.sin().to(torch.float32)[token_delta]  # [T, head_dim // 2]
        # The tensor itself is held, so that no other tensor can take its identity, and
        # a copy of its values, to see a change in place.
        self._last_tables = (delta_positions, delta_positions.clone(), device, cos, sin)
        return cos, sin

    def encoder(self, positions: torch.Tensor, q: torch.Tensor | None,
                k: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A `PositionalEncoder`: rotate token-first q and k forward by `positions`.

        Args:
            positions: integer `[num_tokens]`: where to rotate each token to (a delta
                when q/k already carry RoPE).
            q: token-first `[num_tokens, ..., head_dim]` or None (returned as None).
            k: token-first `[num_tokens, ..., head_dim]`.

        Returns:
            (q, k) rotated; new tensors.
        """
        rotated_q = None if q is None else self.rotate(q, positions, 0)
        return rotated_q, self.rotate(k, positions, 0)

    def reverse_encoder(self, positions: torch.Tensor, q: torch.Tensor | None,
                        k: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A `PositionalEncoder` undoing `encoder(positions, ...)`: rotate by -positions."""
        return self.encoder(-positions, q, k)


@dataclasses.dataclass(frozen=True)
class RopeSettings:
    """A model's RoPE settings, as `LlamaRotary.from_params` takes them.

    Attributes:
        head_dim: width of one attention head.
        rope_theta: the RoPE base.
        rope_scaling: the rope type and its parameters (`rope_type`, `factor`, ...); {}
            for plain RoPE.
    """

    head_dim: int
    rope_theta: float
    rope_scaling: dict


def rope_settings(config) -> RopeSettings:
    """Read a Llama-family config's RoPE: the one reader of these settings, for the
    Hugging Face path (`LlamaRotary.from_model`) and vLLM's (`from_config`).

    Reads `rope_parameters` (transformers 5) over `rope_scaling` (older; the legacy key
    "type" for "rope_type"), `rope_theta` from them or the config (10000 where neither
    has it), `partial_rotary_factor` from them or the config, and `head_dim` (else
    hidden_size / num_attention_heads).

    Raises:
        ValueError: per-layer-type RoPE (e.g. Gemma's), a rope type a delta rotation is
            not exact for (dynamic, longrope, yarn, unknown), or a partial rotary.
    """
    params = {**(getattr(config, "rope_scaling", None) or {}),
              **(getattr(config, "rope_parameters", None) or {})}
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError("per-layer-type RoPE (e.g. Gemma's) is not supported: one "
                         "rotation must serve every layer")
    _check_rope_type(params.get("rope_type", params.get("type", "default")))
    head_dim = (getattr(config, "head_dim", None)
                or config.hidden_size // config.num_attention_heads)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial rotary (factor {partial} of {head_dim} dims) is not "
                         "supported")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return RopeSettings(head_dim, float(theta), params)


def _check_rope_type(rope_type: str) -> str:
    """Return rope_type if a delta rotation is exact for it, else raise ValueError."""
    if rope_type in _SUPPORTED_ROPE_TYPES:
        return rope_type
    why = _REFUSED_WHY.get(rope_type, "it is not a RoPE type this module knows")
    raise ValueError(f"rope_type {rope_type!r} cannot be re-rotated by a position delta: {why}; "
                     f"supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                     high_freq_factor: float, original_max_positions: float) -> torch.Tensor:
    """Llama 3's frequency rescaling (Meta's Llama 3.1 release; transformers' "llama3").

    Wavelengths longer than original_max_positions / low_freq_factor are slowed by
    `factor`; those shorter than original_max_positions / high_freq_factor are kept;
    those in between are interpolated linearly in original_max_positions / wavelength.
    """
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = original_max_positions / low_freq_factor
    high_freq_wavelength = original_max_positions / high_freq_factor
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    smooth = ((original_max_positions / wavelength - low_freq_factor)
              / (high_freq_factor - low_freq_factor))
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, blended, scaled)
