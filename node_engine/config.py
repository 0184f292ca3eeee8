"""Engine configuration: one frozen dataclass, validated on construction.

Values computed at run time (the KV pool size, the context length actually
used) are not written back here; they live in the runner's ``KVPlan``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from handoff.service.flag_types import seconds_problem
from handoff.service.limits import DEFAULT_MAX_BODY_BYTES
from node_engine.memory.tags import BackupMode
from node_engine.model.arch import MIN_CONTEXT_TOKENS
from node_engine.vision.decode import DEFAULT_MAX_IMAGE_PIXELS

DEFAULT_CPU_MAX_TOTAL_TOKENS = 8192
DEFAULT_WEIGHT_VERSION = "default"


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the flag."""


MIN_REQUEST_ROOM_TOKENS = MIN_CONTEXT_TOKENS  # the least pool or context that takes a one-token prompt


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    device: str = "cpu"
    dtype: str | None = None                 # None: float32 on CPU, bfloat16 on CUDA
    seed: int = 0
    max_total_tokens: int | None = None      # None: CPU fixed default, CUDA sized from free memory
    max_batch_tokens: int = 2048
    max_running_requests: int = 64
    schedule_conservativeness: float = 1.0   # SGLang's: the initial new_token_ratio is 0.7 times it (at most 1)
    context_length: int | None = None        # None: the model's max_position_embeddings
    enable_memory_saver: bool = False
    weights_backup: BackupMode = BackupMode.NONE
    backup_dir: Path | None = None
    disable_cuda_graph: bool = False
    enable_torch_compile: bool = False       # CPU: decode through torch.compile (compiled at start)
    cuda_graph_max_bs: int = 32
    mem_fraction: float = 0.85
    model_override: str | None = None        # JSON object, built-in models only
    served_model_name: str | None = None
    weight_version: str = DEFAULT_WEIGHT_VERSION
    free_memory_override_file: Path | None = None
    fault_drill_file: Path | None = None     # fault drill: a one-shot step or control fault (node_engine.failures)
    reload_timeout: float = 300.0            # seconds a checkpoint read may take before a reload is a 504
    weight_sync_timeout: float = 300.0       # seconds a group join or one broadcast may take
    health_step_timeout: float = 300.0       # seconds one step may run before /health answers 503 (a hung step)
    role: str = "mixed"
    enable_prefix_cache: bool = True
    # Vision-language models (see docs/memory.md, "The vision path"):
    max_image_tokens: int | None = None         # per image, after the merge; None: --max-batch-tokens
    visual_batch_max_tokens: int | None = None  # image tokens encoded per step; None: --max-batch-tokens, 0: off
    vision_reserve_mb: int | None = None        # None: measured at start from the worst-case image batch
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # decoded pixels per image (decompression-bomb bound)
    allowed_local_media_path: Path | None = None      # image paths are read only below it (None: never)
    # CPU: the most resident memory (RSS) the engine process may use; the KV pool is sized from it.
    memory_budget_mb: int | None = None
    incremental_streaming_output: bool = False  # stream events carry only what is new (SGLang's flag)
    sampling_defaults: str = "model"  # chat's defaults: the model's generation_config.json, or "openai"
    return_original_logprob: bool = False       # output logprobs without the temperature (node_engine/logprobs.py)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.dtype is not None and self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"--dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.role not in ("mixed", "prefill", "decode"):
            raise ConfigError(f"--role must be mixed, got {self.role!r}")
        if self.role != "mixed":
            raise ConfigError(
                f"--role {self.role} is not available yet: moving KV from a prefill engine to a decode engine is a "
                "later milestone. Run engines as mixed; the LB's PD routing works with PD-capable engines.")
        for name in ("max_batch_tokens", "max_running_requests", "cuda_graph_max_bs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_total_tokens", "context_length"):
            value = getattr(self, name)
            if value is not None and value < MIN_REQUEST_ROOM_TOKENS:
                # below it SGLang's max_req_input_len (the smaller, less 6) refuses every prompt: an engine up for
                # nothing (SGLang starts so too)
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {MIN_REQUEST_ROOM_TOKENS} (the least that "
                                  f"takes a one-token prompt), got {value}")
        if not self.schedule_conservativeness >= 0:  # SGLang's check; NaN refused too
            raise ConfigError(f"--schedule-conservativeness must be >= 0, got {self.schedule_conservativeness}")
        if not 0 < self.mem_fraction <= 1:
            raise ConfigError(f"--mem-fraction must be in (0, 1], got {self.mem_fraction}")
        if self.enable_torch_compile and self.device != "cpu":
            raise ConfigError("--enable-torch-compile is for CPU engines; on CUDA, decode runs through CUDA graphs")
        if self.weights_backup is not BackupMode.NONE and not self.enable_memory_saver:
            raise ConfigError("--weights-backup needs --enable-memory-saver")
        if self.backup_dir is not None and self.weights_backup is BackupMode.NONE:
            # it would be left empty, and a release discard the weights its owner believes backed up
            raise ConfigError("--backup-dir holds a weights backup, and there is none: add --enable-memory-saver "
                              "--weights-backup cpu|disk, or leave --backup-dir out")
        for name in ("reload_timeout", "weight_sync_timeout", "health_step_timeout"):
            problem = seconds_problem(getattr(self, name))
            if problem is not None:
                raise ConfigError(f"--{name.replace('_', '-')} must be {problem}")
        if not self.weight_version.strip():
            raise ConfigError("--weight-version must not be blank")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("--served-model-name must not be blank (leave it out for the path's last part)")
        for name in ("max_image_tokens", "memory_budget_mb", "max_image_pixels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("visual_batch_max_tokens", "vision_reserve_mb"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        self._check_paths()
        if self.memory_budget_mb is not None and self.device != "cpu":
            raise ConfigError("--memory-budget-mb is for CPU engines; on CUDA the KV pool is sized from the "
                              "device's free memory (--mem-fraction)")
        self.model_override_dict()  # validates the JSON

    def _check_paths(self) -> None:
        if self.allowed_local_media_path is not None and not self.allowed_local_media_path.is_dir():
            raise ConfigError(f"--allowed-local-media-path {self.allowed_local_media_path} is not a folder")
        # made on the first release that needs it; a file in its place would fail that release, not the start
        if self.backup_dir is not None and self.backup_dir.exists() and not self.backup_dir.is_dir():
            raise ConfigError(f"--backup-dir {self.backup_dir} is not a folder")
        for name in ("free_memory_override_file", "fault_drill_file"):
            path = getattr(self, name)
            if path is not None and path.is_dir():
                raise ConfigError(f"--{name.replace('_', '-')} {path} is a folder, not a file")

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device == "cuda" else "float32")

    @property
    def resolved_max_image_tokens(self) -> int:
        return self.max_image_tokens if self.max_image_tokens is not None else self.max_batch_tokens

    @property
    def resolved_visual_batch_max_tokens(self) -> int:
        """0: no per-step limit."""
        if self.visual_batch_max_tokens is not None:
            return self.visual_batch_max_tokens
        return self.max_batch_tokens

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path.rstrip("/").split("/")[-1] or self.model_path

    def model_override_dict(self) -> dict[str, Any]:
        if not self.model_override:
            return {}
        try:
            value = json.loads(self.model_override)
        except ValueError as exc:
            raise ConfigError(f"--model-override is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ConfigError("--model-override must be a JSON object")
        return value


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    port_file: Path | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_format: str = "text"
    log_level: str = "info"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
