"""Where a model lives: an HF checkpoint directory, or a GGUF file (or a directory holding one).

Every loader (architecture config, tokenizer, weights, the KV layout's fingerprint, the router's
tokenizer) goes through `Checkpoint.resolve`, so MODEL means the same thing to every role. Nothing
here imports torch: the router resolves checkpoints too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A resolved MODEL: `directory` holds config and tokenizer files, or the GGUF file."""

    directory: Path
    gguf_file: str | None = None  # file name inside directory when the weights are GGUF

    @classmethod
    def resolve(cls, model: str | Path) -> Checkpoint:
        """ValueError when MODEL is neither a .gguf file nor a directory we can read."""
        path = Path(model).expanduser()
        if path.is_file():
            if path.suffix != ".gguf":
                raise ValueError(f"model {model}: a file must be a .gguf checkpoint")
            return cls(path.parent, path.name)
        if not path.is_dir():
            raise ValueError(f"model {model}: no such file or directory")
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        # A directory is a GGUF checkpoint when a .gguf file holds its only weights.
        if ggufs and not _has_hf_weights(path):
            if len(ggufs) > 1:
                raise ValueError(f"model {model} holds several .gguf files {ggufs}: name one")
            return cls(path, ggufs[0])
        if (path / "config.json").is_file():
            return cls(path)
        raise ValueError(f"model {model}: no config.json and no .gguf file")

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def gguf_path(self) -> Path:
        assert self.gguf_file is not None, "not a GGUF checkpoint"
        return self.directory / self.gguf_file

    def hf_dir(self) -> Path:
        """The directory transformers reads config and tokenizer from: the checkpoint's own,
        or for a GGUF file its metadata converted once into the cache (parsing a GGUF's
        tokenizer takes seconds, and every role of a deployment would pay it at each start)."""
        if not self.is_gguf:
            return self.directory
        st = self.gguf_path.stat()
        ident = f"{self.gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        key = hashlib.sha256(ident.encode()).hexdigest()[:16]
        out = cache_dir() / "gguf-meta" / f"{self.gguf_path.stem}-{key}"
        if not (out / "config.json").is_file():
            self._convert_metadata(out)
        return out

    def _convert_metadata(self, out: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from pdserve.common.model.gguf import check_architecture, config_fields, open_reader

        reader = open_reader(self.gguf_path)
        check_architecture(self.gguf_path, reader)
        fields = config_fields(reader)
        del reader  # its parsed metadata, before transformers parses the file again
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
        try:
            kwargs = {"gguf_file": self.gguf_file}
            config = AutoConfig.from_pretrained(self.directory, **kwargs)
            _completed(config, *fields).save_pretrained(tmp)
            AutoTokenizer.from_pretrained(self.directory, **kwargs).save_pretrained(tmp)
            os.replace(tmp, out)  # atomic; another process may have won the race: fine
        except OSError:
            if not (out / "config.json").is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def hf_config(self) -> Any:
        """The transformers config (from the GGUF metadata for a GGUF file)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.hf_dir(), local_files_only=True)

    def generation_config(self) -> Any | None:
        if not (self.hf_dir() / "generation_config.json").is_file():
            return None
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(self.hf_dir(), local_files_only=True)

    def config_dict(self) -> dict[str, Any]:
        """config.json as it is written (no transformers, hence no torch)."""
        with open(self.hf_dir() / "config.json", encoding="utf-8") as f:
            return json.load(f)

    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer. When its tokenizer_config names the generic fast class
        (Llama 3's checkpoints, every GGUF conversion) that class loads it directly: the
        AutoTokenizer path imports transformers' config module, which imports torch, and the
        router, which only tokenizes, has no use for torch's half a gigabyte."""
        hf_dir = self.hf_dir()
        if (hf_dir / "tokenizer.json").is_file() and _tokenizer_class(hf_dir) in _GENERIC_FAST:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(hf_dir, local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)


def _completed(config: Any, model_type: str | None, fields: dict[str, Any]) -> Any:
    """transformers' config of a GGUF file with the mixture-of-experts fields its reader
    leaves out (`gguf.config_fields`): Mixtral, which llama.cpp writes as "llama", rebuilt
    as a Mixtral config."""
    if model_type is None:
        for key, value in fields.items():
            setattr(config, key, value)
        return config
    from transformers import AutoConfig

    kept = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    return AutoConfig.for_model(model_type, **kept, **fields)


# What transformers 4 and 5 call the tokenizer backed by tokenizer.json alone.
_GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer_class(hf_dir: Path) -> str | None:
    try:
        with open(hf_dir / "tokenizer_config.json", encoding="utf-8") as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def _has_hf_weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))


def cache_dir() -> Path:
    """Where pdserve keeps what it downloads or converts (`PDSERVE_CACHE_DIR` overrides)."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
