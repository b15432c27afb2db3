"""vLLM's `LoRARequest`: the name, the id and the directory of an adapter a request runs with."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoRARequest:
    """An adapter, as vLLM names one: `lora_int_id` (>= 1) identifies it in the engine (slots, prefix cache),
    `lora_name` in the server's API, `lora_path` is its PEFT directory (adapter_config.json and
    adapter_model.safetensors). Requests equal in name are the same adapter (vLLM's hash and equality)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    long_lora_max_len: int | None = None
    base_model_name: str | None = field(default=None)
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty str.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} must be an int >= 1 (0 is the base model).")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r} must name the adapter's directory.")
        if self.long_lora_max_len is not None:
            raise ValueError(f"long_lora_max_len={self.long_lora_max_len}: pagellm runs no long-context LoRA; "
                             "pass None.")
        if self.tensorizer_config_dict is not None:
            raise ValueError("tensorizer_config_dict: pagellm loads adapters from PEFT directories only; pass None.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
