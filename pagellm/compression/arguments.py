"""`pagellm quantize`'s arguments and the schemes it writes: free of torch, so that the command line's parser
(pagellm/entrypoints/cli.py, which `pagellm serve` shares) loads none of the pipeline (oneshot.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Scheme:
    """A compressed-tensors preset: how weights round, what activations the serving engine quantizes, and the
    format the weights are stored in."""

    name: str
    kind: str  # "int", "float" (fp8 e4m3) or "nvfp4" (e2m1 in groups of 16, fp8 scales, a global scale)
    bits: int
    group_size: int | None
    activations: bool  # dynamic per-token activations of the weights' type (W8A8); False: weight-only
    format: str
    symmetric: bool = True


SCHEMES = {s.name: s for s in (
    Scheme("FP8_DYNAMIC", "float", 8, None, True, "float-quantized"),
    Scheme("W8A8", "int", 8, None, True, "int-quantized"),
    Scheme("W4A16", "int", 4, 128, False, "pack-quantized"),
    Scheme("W4A16_ASYM", "int", 4, 128, False, "pack-quantized", symmetric=False),
    Scheme("W8A16", "int", 8, None, False, "pack-quantized"),
    Scheme("NVFP4A16", "nvfp4", 4, 16, False, "nvfp4-pack-quantized"),
)}
METHODS = ("gptq", "rtn")


@dataclass
class QuantizeArgs:
    model: str
    output: str
    scheme: str = "FP8_DYNAMIC"
    method: str = "gptq"
    group_size: int | None = None  # None: the scheme's
    num_samples: int = 64
    sample_length: int = 256
    calibration_files: list[str] = field(default_factory=list)
    dampening_frac: float = 0.1
    block_size: int = 128
    # Linear layers of the decoder stack left dense; the LM head and whatever lies outside the stack always are.
    ignore: list[str] = field(default_factory=list)
    seed: int = 0
    batch_size: int = 4

    def check(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme={self.scheme!r} is not one pagellm writes; choose one of {sorted(SCHEMES)}")
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not supported; choose one of {list(METHODS)}")
        for name, value, low in (("num_samples", self.num_samples, 1), ("sample_length", self.sample_length, 2),
                                 ("block_size", self.block_size, 1), ("batch_size", self.batch_size, 1)):
            if value < low:
                raise ValueError(f"{name}={value} must be at least {low}")
        if self.group_size is not None and (self.group_size < 1 or SCHEMES[self.scheme].kind != "int"):
            raise ValueError(f"group_size={self.group_size} must be a positive number of inputs, on an int scheme")
        if not 0 <= self.dampening_frac < 1:
            raise ValueError(f"dampening_frac={self.dampening_frac} must lie in [0, 1)")
