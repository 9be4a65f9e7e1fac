"""Load a target/draft pair and its tokenizer from local paths, GGUF files or hub ids, with clear errors."""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from decode.compat import IncompatibleModelsError, check_causal, check_tokenizers
from decode.gguf import find_gguf, load_gguf_model, load_gguf_tokenizer
from decode.vocab_map import load_pretrained, pruned_size

# huggingface_hub, transformers and peft are imported where they are used: `python -m decode bench` sets
# HF_HUB_OFFLINE after `import decode`, and huggingface_hub reads it once, when it is first imported.

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "auto": "auto"}


def resolve_dtype(name: str | torch.dtype | None) -> Any:
    """``"float32" | "bfloat16" | "float16" | "auto"`` (or a torch.dtype) -> the value for ``from_pretrained``;
    None stays None (the checkpoint's own default).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


class RemoteCodeError(ValueError):
    """A checkpoint ships its own Python code (``auto_map``) and ``trust_remote_code`` is off."""


def looks_local(name_or_path: str) -> bool:
    """True for a filesystem path (starts with ``.``, ``/`` or ``~``, exists, names a ``.gguf`` file, or has more
    than one ``/`` before an ``@revision``) rather than a hub id ``name`` or ``org/name``."""
    name = str(name_or_path)
    return (name.startswith((".", os.sep, "~")) or os.path.exists(name) or name.lower().endswith(".gguf")
            or name.partition("@")[0].count("/") > 1)


def recorded_name(name_or_path: str) -> str:
    """How a model's name is recorded for later (a checkpoint's state, an export's card): a local path made
    absolute (``~`` expanded), since a relative one names nothing from another working folder; a hub id as is."""
    if looks_local(name_or_path):
        return str(Path(os.path.expanduser(str(name_or_path))).resolve())
    return str(name_or_path)


def local_folder(name_or_path: str) -> str | None:
    """The folder a model name stands for: a local path that is a directory (``~`` expanded), or for a hub id
    (``org/name``) the snapshot folder that ``refs/main`` of the local Hugging Face cache points to, found by
    huggingface_hub's own offline lookup (``snapshot_download(local_files_only=True)``, no network). None when it
    is neither (a missing path, a hub id not in the cache, a malformed id)."""
    path = os.path.expanduser(str(name_or_path))
    if os.path.isdir(path):
        return path
    if looks_local(name_or_path):
        return None
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(str(name_or_path), local_files_only=True)
    except (OSError, ValueError):  # LocalEntryNotFoundError (not cached), HFValidationError (not an id)
        return None


def hub_revision(name_or_path: str) -> str | None:
    """The commit of the local Hugging Face cache snapshot a hub id (``org/name``) loads from: the snapshot folder's
    name, which ``refs/main`` points to (40 hex digits). None for a local folder or path, and for an id that is not
    in the cache. Recorded beside the bare id in run states, export cards, logit-cache manifests, bench and certify
    JSON, so that a result names the exact weights (a later ``hf download`` moves ``refs/main``)."""
    if looks_local(name_or_path):  # (any existing path, ``~`` ones included)
        return None
    folder = local_folder(name_or_path)
    return None if folder is None else os.path.basename(os.path.normpath(folder))


_offline_by: str | None = None  # the command that set HF_HUB_OFFLINE itself (run_offline), for its errors


def run_offline(command: str) -> None:
    """Set ``HF_HUB_OFFLINE=1`` for ``command`` (e.g. ``"decode bench"``: a benchmark reaches no network) unless
    the user set it either way. Call it before transformers is imported (huggingface_hub reads it once)."""
    global _offline_by
    if "HF_HUB_OFFLINE" not in os.environ:
        os.environ["HF_HUB_OFFLINE"] = "1"
        _offline_by = command


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _not_cached(name: str, role: str) -> str:
    """Why a hub id cannot be loaded offline, with the cached ids it may be a misspelling of and the fixes."""
    from huggingface_hub import constants, scan_cache_dir

    try:
        # the cache folder read now (scan_cache_dir's default is the one its module saw when first imported)
        cached = [r.repo_id for r in scan_cache_dir(constants.HF_HUB_CACHE).repos if r.repo_type == "model"]
    except Exception:  # no cache folder yet, or one huggingface_hub cannot read: no suggestions
        cached = []
    close = difflib.get_close_matches(name, cached, n=3)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    repo, _, revision = name.partition("@")
    at = " A revision is not part of the id: the cache's refs/main is what loads." if revision else ""
    get = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    offline = ("HF_HUB_OFFLINE is set" if _offline_by is None else
               f"{_offline_by} runs offline (HF_HUB_OFFLINE=1 unless you set HF_HUB_OFFLINE=0)")
    return (f"{role} {name!r} is not a local folder, and as a hub id it is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) while {offline}{hint}.{at} Download it where the hub is "
            f"reachable ({get}) or pass a directory written by save_pretrained.")


def _shadow_hint(name: str) -> str:
    """For a relative folder named like a hub id (``org/name``): that it, not the cached hub model, was read."""
    if name.startswith((".", os.sep, "~")) or name.count("/") != 1 or not os.path.isdir(name):
        return ""
    return (f" ({name!r} is the folder ./{name} of the current directory, which shadows the hub id of that name; "
            "run from another directory to load the cached hub model)")


def check_model_path(name_or_path: str, role: str) -> None:
    """A value that looks like a local path (:func:`looks_local`) must be a folder, as ``from_pretrained`` needs, or
    a GGUF file (:func:`decode.gguf.find_gguf`); a hub id (``org/name``) is left to the loader (:func:`check_cached`
    checks it offline). Raises FileNotFoundError naming ``role`` (e.g. ``draft`` or a CLI's ``--draft``) and whether
    the path is missing, a file that is not GGUF, or a folder of several GGUF files."""
    if not looks_local(name_or_path) or find_gguf(name_or_path, f"{role} path") is not None:
        return
    if not os.path.isdir(os.path.expanduser(name_or_path)):
        what = "is a file, not a checkpoint folder" if os.path.exists(os.path.expanduser(name_or_path)) else \
            "does not exist"
        raise FileNotFoundError(f"{role} path {shown_path(name_or_path)} {what}; pass a directory written by "
                                "save_pretrained or a .gguf file (or a hub id when online)")


def shown_path(path: str | os.PathLike) -> str:
    """A path as an error message shows it: as given, and where it points when that differs (a relative path is
    taken from the current folder, ``~`` expanded)."""
    where = os.path.abspath(os.path.expanduser(str(path)))
    return repr(str(path)) + ("" if where == str(path) else f" ({where})")


def check_cached(name_or_path: str, role: str) -> None:
    """:func:`check_model_path`, and offline (``HF_HUB_OFFLINE``) a hub id must be in the local Hugging Face cache:
    a FileNotFoundError naming ``role``, close cached ids and the fixes, instead of the loader's network error."""
    check_model_path(name_or_path, role)
    if not looks_local(name_or_path) and _offline() and local_folder(name_or_path) is None:
        raise FileNotFoundError(_not_cached(str(name_or_path), role))


def peft_adapter_base(folder: str | os.PathLike) -> str | None:
    """The base a peft adapter folder names (``base_model_name_or_path`` of its ``adapter_config.json``; ``""``
    when it names none), or None for a folder that is not an adapter (it has a ``config.json``, or no adapter
    config)."""
    path = Path(folder)
    if (path / "config.json").exists() or not (path / "adapter_config.json").is_file():
        return None
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (ValueError, UnicodeDecodeError):
        config = None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return str(base) if base else ""


def run_draft_base(run_folder: str | Path, recorded: str | None) -> str | None:
    """The LoRA base of a checkpoint in ``run_folder``: when ``recorded`` names a distill run's ``draft_base``
    folder (a built or pruned draft, saved inside its run) and ``run_folder`` has its own, that one. The recorded
    path is absolute, so after the run folder is moved or copied it names the old place, which may be gone or
    hold another run's ``draft_base``. Anything else is returned as it is."""
    if recorded and Path(str(recorded)).name == "draft_base":
        own = Path(run_folder).resolve() / "draft_base"
        if (own / "config.json").is_file():
            return str(own)
    return recorded


def _load_merged_adapter(folder: str, base: str, name_or_path: str, role: str, dtype: Any, device: str | None,
                         trust_remote_code: bool) -> Any:
    """:func:`load_causal_lm` of a peft adapter folder: its base through the same loader, the adapter merged in
    (a tied embedding/head pair that the adapter touches is untied first: :func:`untie_adapted_weights`)."""
    from peft import PeftModel

    config_file = os.path.join(folder, "adapter_config.json")
    if not base:
        raise FileNotFoundError(f"the {role} {name_or_path!r} is a peft adapter whose adapter_config.json names no "
                                "base_model_name_or_path; set it to the model the adapter was trained on, or give a "
                                "merged model (PeftModel.merge_and_unload, then save_pretrained)")
    base = run_draft_base(Path(folder).resolve().parent.parent, base)  # a distill run's <run>/<checkpoint>/draft
    chain, step = [os.path.realpath(folder)], base
    while step and (nxt := local_folder(step)) is not None and (after := peft_adapter_base(nxt)) is not None:
        if os.path.realpath(nxt) in chain:  # each adapter names the next as its base: it would never end
            raise FileNotFoundError(f"the {role} adapter {name_or_path!r}: its base_model_name_or_path chain "
                                    f"{' -> '.join(chain + [os.path.realpath(nxt)])} returns to an adapter it "
                                    f"passed; set base_model_name_or_path in {config_file} to the model it was "
                                    "trained on")
        chain.append(os.path.realpath(nxt))
        step = after
    if looks_local(base) and not os.path.isdir(os.path.expanduser(base)):
        raise FileNotFoundError(f"the {role} {name_or_path!r} is a peft adapter whose base_model_name_or_path "
                                f"{base!r} is not a folder; set base_model_name_or_path in {config_file} to "
                                "where the base is now (a relative path is read from the working folder).")
    beside = Path(folder).resolve().parent / base
    if not looks_local(base) and local_folder(base) is None and beside.is_dir():  # not a hub id: a relative path
        raise FileNotFoundError(f"the {role} {name_or_path!r} is a peft adapter whose base_model_name_or_path "
                                f"{base!r} is read from the working folder (as peft does), where it is not; {beside} "
                                f"exists: set base_model_name_or_path in {config_file} to that absolute path")
    model = load_causal_lm(base, f"base of the {role} adapter {name_or_path!r}", dtype, None, trust_remote_code)
    try:
        peft_model = PeftModel.from_pretrained(model, folder)
        untie_adapted_weights(peft_model)
        model = peft_model.merge_and_unload()
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise FileNotFoundError(f"could not apply the {role} adapter {name_or_path!r} to its base {base!r} "
                                f"(base_model_name_or_path): {err}") from err
    return _ready(model, role, device)


def untie_adapted_weights(peft_model: Any) -> bool:
    """Give the output head its own copy of a tied embedding matrix when a LoRA adapter sits on either of them.

    Merging writes ``W + BA`` into the adapted weight; tied to the other, it would move the input embeddings too
    (so the merged model would differ from the adapter model that was trained and evaluated). After untying, the
    merged model computes the same function as base + adapter, and its config says the weights are untied.
    Returns True when it untied something; a tied pair that no adapter touches stays tied (untying it would grow the
    export by a vocabulary-sized matrix and change its architecture for nothing).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    model = peft_model.get_base_model()
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None:
        return False
    out_w = getattr(out, "base_layer", out).weight
    in_w = getattr(inp, "base_layer", inp).weight
    adapted = any(isinstance(m, (BaseTunerLayer, ModulesToSaveWrapper)) for m in (out, inp))
    if out_w.data_ptr() != in_w.data_ptr() or not adapted:
        return False
    head = getattr(out, "base_layer", out)
    head.weight = torch.nn.Parameter(out_w.detach().clone(), requires_grad=out_w.requires_grad)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    return True


def load_causal_lm(name_or_path: str, role: str = "model", dtype: str | torch.dtype | None = "float32",
                   device: str | None = None, trust_remote_code: bool = False) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` in eval mode with frozen weights (``dtype=None``: the checkpoint's
    default). The one model loader of decode and distill. A vocabulary-pruned draft comes back with its N-row head
    and its id map (:func:`decode.vocab_map.load_pretrained`).

    ``trust_remote_code`` (default False; ``--trust-remote-code`` on the CLIs) lets a checkpoint whose config names
    its own modeling code (``auto_map``) import and run that Python code; leave it off for checkpoints you have not
    read.

    A checkpoint that names its own code but whose ``model_type`` transformers knows is built with transformers'
    own class (as ``from_pretrained`` does), with a UserWarning saying so.

    A peft adapter folder (``adapter_config.json``, no ``config.json``: a LoRA run's ``best/draft``) is loaded as
    its base (``base_model_name_or_path``, itself through this loader, so a vocabulary-pruned base keeps its head
    and map) with the adapter merged in (``PeftModel.merge_and_unload``): what base + adapter compute, as one model.

    A GGUF file (``*.gguf``, or a folder with no ``config.json`` and one ``.gguf`` file) is dequantized to ``dtype``
    and rebuilt as a plain model (:func:`decode.gguf.load_gguf_model`, which logs the file's tensor types).

    Raises:
        RemoteCodeError: (a ValueError) the checkpoint ships its own code, transformers has no class for its
            ``model_type``, and ``trust_remote_code`` is off.
        ValueError: ``device`` is not a torch device, or a CUDA device this torch build or machine lacks.
        FileNotFoundError: ``name_or_path`` looks like a local path but is not a directory, or it could not be
            loaded (not a checkpoint folder, or a hub id that is not cached while offline; an adapter that names no
            base or does not fit it), naming the role.
    """
    name_or_path = str(name_or_path)
    if device is not None:  # (0 is a device: cuda:0)
        device = check_device(device)  # before the weights load: a device this torch build lacks is a ValueError
    check_cached(name_or_path, role)
    kw = {"dtype": resolve_dtype(dtype)} if dtype is not None else {}
    gguf_file = find_gguf(name_or_path, role) if looks_local(name_or_path) else None
    if gguf_file is not None:
        return _ready(load_gguf_model(gguf_file, kw.get("dtype"), role), role, device)
    folder = local_folder(name_or_path)  # a pruned draft's id map is read from its folder, a cached hub id's too
    base = peft_adapter_base(folder) if folder else None
    if base is not None:
        return _load_merged_adapter(folder, base, name_or_path, role, dtype, device, trust_remote_code)
    try:
        source = folder if folder and pruned_size(folder) is not None else os.path.expanduser(name_or_path)
        model = load_pretrained(source, **kw, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        if isinstance(err, ValueError) and "trust_remote_code" in str(err):
            raise RemoteCodeError(f"the {role} {name_or_path!r} ships its own Python code (auto_map in its "
                                  "config.json), which is not run unless you pass --trust-remote-code; read that "
                                  "code first") from err
        local = os.path.expanduser(name_or_path)
        if os.path.isfile(os.path.join(local, "trainer_state.json")):  # a distill run's step_N or best
            raise FileNotFoundError(
                f"could not load the {role} from {name_or_path!r}: it is a distill training checkpoint, not a "
                f"Hugging Face model folder; export it first (python -m distill export {name_or_path} OUT_DIR), "
                f"then give OUT_DIR") from err
        if os.path.isdir(local):  # a local folder: its own problem is the message
            raise FileNotFoundError(f"could not load the {role} from {name_or_path!r}: {err}"
                                    f"{_shadow_hint(name_or_path)}") from err
        raise FileNotFoundError(
            f"could not load the {role} {name_or_path!r}: not a local checkpoint directory, and the hub is not "
            f"reachable or has no such model ({err.__class__.__name__}). Pass a local path written by save_pretrained."
        ) from err
    auto_map = {} if trust_remote_code else (getattr(model.config, "auto_map", None) or {})
    own = auto_map.get("AutoModelForCausalLM") or auto_map.get("AutoModel")
    if own:  # transformers built its own class: say so, the checkpoint may expect its code
        warnings.warn(f"decode: the {role} {name_or_path!r} names its own code (auto_map: "
                      f"{own}), which is not run: it was built with transformers' "
                      f"{type(model).__name__} (model_type {model.config.model_type!r}). Pass --trust-remote-code "
                      "(distill: *.trust_remote_code=true) to run its code instead, after reading it", stacklevel=2)
    return _ready(model, role, device)


def _ready(model: Any, role: str, device: str | None) -> Any:
    """``model`` in eval mode with frozen weights, on ``device`` (None: where it is), checked to be a causal LM."""
    model.eval().requires_grad_(False)
    if device is not None:
        model.to(device)
    check_causal(model, role)  # a masked LM loads as a causal-LM class with only a transformers warning
    return model


# Files a saved tokenizer has at least one of (fast, slow or sentencepiece); an adapter folder without any has none.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "merges.txt")


def has_tokenizer_files(folder: str | None, files: tuple[str, ...] = TOKENIZER_FILES) -> bool:
    """Whether ``folder`` (None: no folder) holds at least one of ``files``."""
    return bool(folder) and any(os.path.exists(os.path.join(folder, f)) for f in files)


def load_tokenizer(name_or_path: str, role: str = "tokenizer", pad_from_eos: bool = False,
                   trust_remote_code: bool = False, fix: str = "pass --tokenizer PATH") -> Any:
    """``AutoTokenizer.from_pretrained`` with a clear error when it is missing (a peft adapter folder saved without
    a tokenizer gives its base's, ``base_model_name_or_path``; a GGUF file gives the one in its metadata,
    :func:`decode.gguf.load_gguf_tokenizer`). ``pad_from_eos``: a tokenizer
    without a pad token gets eos as pad (batched generation and training pad their rows). ``trust_remote_code``:
    see :func:`load_causal_lm`. ``fix``: how the caller's user names another tokenizer (a CLI flag, a setting).

    Raises:
        RemoteCodeError: the tokenizer ships its own code and ``trust_remote_code`` is off.
        FileNotFoundError: the tokenizer cannot be loaded, or ``pad_from_eos`` and it has neither pad nor eos.
    """
    from transformers import AutoTokenizer

    check_cached(str(name_or_path), role)
    gguf_file = find_gguf(name_or_path, role) if looks_local(str(name_or_path)) else None
    if gguf_file is not None:
        return _with_pad(load_gguf_tokenizer(gguf_file, role), role, name_or_path, pad_from_eos)
    folder = local_folder(str(name_or_path))
    base = peft_adapter_base(folder) if folder else None
    own_files = has_tokenizer_files(folder)
    if base and not own_files:
        name_or_path = base  # an adapter saved without a tokenizer (plain peft): its base's
        check_cached(str(name_or_path), role)
    elif folder and not own_files:
        # transformers 5 builds a tokenizer of the model type's class with no vocabulary instead of failing
        raise FileNotFoundError(f"the {role} folder {folder} has no tokenizer files (none of "
                                f"{', '.join(TOKENIZER_FILES[:4])}, ...). Save the tokenizer next to the model "
                                f"(tokenizer.save_pretrained) or {fix}.")
    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(str(name_or_path)), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as err:
        if isinstance(err, ValueError) and "trust_remote_code" in str(err):
            raise RemoteCodeError(f"the {role} {name_or_path!r} ships its own Python code (auto_map in its "
                                  "tokenizer_config.json), which is not run unless you pass --trust-remote-code; read "
                                  "that code first") from err
        raise FileNotFoundError(f"could not load the {role} from {name_or_path!r}: {err}. Save the tokenizer next to "
                                f"the model (tokenizer.save_pretrained) or {fix}.{_shadow_hint(str(name_or_path))}"
                                ) from err
    return _with_pad(_as_saved(tok, str(name_or_path)), role, name_or_path, pad_from_eos)


def _with_pad(tok: Any, role: str, name_or_path: str, pad_from_eos: bool) -> Any:
    """``tok``, with eos as its pad token when ``pad_from_eos`` and it has none (FileNotFoundError: no eos either)."""
    if pad_from_eos and tok.pad_token_id is None:
        if tok.eos_token is None:
            raise FileNotFoundError(f"the {role} {name_or_path!r} has neither a pad nor an eos token; add a pad token "
                                    "(tokenizer.add_special_tokens) and save it again")
        tok.pad_token = tok.eos_token
    return tok


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _as_saved(tok: Any, name_or_path: str) -> Any:
    """The tokenizer as its files were saved. A tokenizer saved with a generic class (``TokenizersBackend``, e.g. one
    trained with the tokenizers library) into a folder whose config.json names a model type that has its own class
    (qwen2) comes back from transformers 5's ``AutoTokenizer`` as that class, which may add tokens: a Llama-vocabulary
    tokenizer in a Qwen2 draft's folder gained ``<|endoftext|>`` as its unk token (8193 ids, refused against the
    target's). Then the saved generic class is loaded instead."""
    folder = local_folder(name_or_path)
    if folder is None:
        return tok
    config = os.path.join(folder, "tokenizer_config.json")
    try:
        with open(config) as f:
            named = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return tok
    if named not in GENERIC_TOKENIZER_CLASSES or type(tok).__name__ == named:
        return tok
    import transformers

    return getattr(transformers, named).from_pretrained(folder)


def default_device() -> str:
    """``"cuda"`` when available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> str:
    """The device to use (``default_device()`` when None); raises ValueError if it is not a torch device string
    (``cpu``, ``cuda``, ``cuda:1``, ``mps``, ...) or a device that this torch build or machine does not have (no
    CUDA, a CUDA index past the device count, no MPS/XPU backend; ``meta``)."""
    device = default_device() if device is None or device == "" else device
    try:
        parsed = torch.device(device)
        device = str(device) if isinstance(device, str) else str(parsed)  # 0 and torch.device("xpu") by name
    except (RuntimeError, ValueError, TypeError) as err:
        raise ValueError(f"device {device!r} is not a torch device: use cpu, cuda or cuda:N ({err})") from None
    kind = parsed.type
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this torch build or machine has no CUDA device; "
                         "use --device cpu (or install a CUDA build of torch on a GPU machine)")
    if kind == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s): use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if kind not in ("cpu", "cuda"):  # mps, xpu, ...: the backend must be there (meta and others hold no weights)
        backend = torch.backends.mps if kind == "mps" else getattr(torch, kind, None)
        if not (kind != "meta" and callable(getattr(backend, "is_available", None)) and backend.is_available()):
            raise ValueError(f"device {device!r} asked for, but this torch build or machine cannot run models on "
                             f"{kind!r}; use --device cpu or cuda")
    return device


def load_target_tokenizer(tokenizer: str | None, target: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer a CLI decodes ``target`` with: ``tokenizer`` (its ``--tokenizer``) or else the target's own.

    A ``--tokenizer`` is checked against the target's own tokenizer when the target's folder (or cached snapshot,
    or GGUF file) has one (:func:`decode.compat.check_tokenizers`: every shared id the same token, the same
    bos/eos/unk; then the same size, which sets the lm_head rows the target may sample), so another chat template
    passes, and a tokenizer of another vocabulary or size does not: the target would silently read and write ids of
    the wrong tokens, or sample rows it was not trained on.

    Raises:
        decode.compat.IncompatibleModelsError: naming ``--tokenizer``, the ids or special tokens that differ.
        FileNotFoundError, RemoteCodeError: as :func:`load_tokenizer`.
    """
    tok = load_tokenizer(tokenizer or target, trust_remote_code=trust_remote_code)
    folder = _own_tokenizer(str(target)) if tokenizer else None
    if folder is not None:
        own = load_tokenizer(folder, "target's tokenizer", trust_remote_code=trust_remote_code)
        try:
            check_tokenizers(own, tok, names=("the target's own tokenizer", "--tokenizer"),
                             fix=f"leave --tokenizer out to use the target's own ({folder}), or give one of its "
                                 "vocabulary")
        except IncompatibleModelsError as err:
            raise IncompatibleModelsError(f"--tokenizer {tokenizer} does not fit the target: {err}") from None
        if len(own) != len(tok):  # the vocabulary size sets which lm_head rows the target may sample
            raise IncompatibleModelsError(
                f"--tokenizer {tokenizer} does not fit the target: it has {len(tok)} tokens, the target's own "
                f"tokenizer ({folder}) {len(own)}; leave --tokenizer out to use the target's own, or save the "
                "tokenizer the target was trained with next to it")
    return tok


def load_draft_tokenizer(draft_path: str, target_tokenizer: Any, trust_remote_code: bool = False,
                         tokenizer_path: str | None = None) -> Any:
    """The draft's tokenizer: ``tokenizer_path`` (a CLI's ``--draft-tokenizer``) when given, else the draft's own
    if its checkpoint folder (or a cached hub id's snapshot, :func:`local_folder`, or its GGUF file) has one (so the
    pair can be checked), else the target's. A tokenizer of another vocabulary than the target's makes the decoder
    draft through the tokens both share (:mod:`decode.cross_vocab`)."""
    if tokenizer_path is not None:
        return load_tokenizer(tokenizer_path, "draft tokenizer", trust_remote_code=trust_remote_code,
                              fix="give a folder, .gguf file or hub id that holds the draft's tokenizer "
                                  "(tokenizer.json or tokenizer_config.json)")
    own = _own_tokenizer(draft_path, ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if own is not None:
        return load_tokenizer(own, "draft tokenizer", trust_remote_code=trust_remote_code)
    return target_tokenizer


def _own_tokenizer(name_or_path: str, files: tuple[str, ...] = TOKENIZER_FILES) -> str | None:
    """Where a model's own tokenizer is: its GGUF file, or its folder (or cached snapshot) when that holds one of
    ``files``; None when it has none."""
    gguf_file = find_gguf(name_or_path) if looks_local(name_or_path) else None
    if gguf_file is not None:
        return str(gguf_file)
    folder = local_folder(name_or_path)
    return folder if has_tokenizer_files(folder, files) else None


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` (``[{"role", "content"}]``) through the tokenizer's chat template, with the
    assistant turn opened (``add_generation_prompt=True``).

    transformers 5 returns a dict (``BatchEncoding``) from ``apply_chat_template``, 4.x a list of ids; both work.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template, so chat messages cannot be turned into a prompt; "
                         "send plain text (/v1/completions, or decode generate without --chat)")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]


# Prefix of target_fingerprint's hashes: a recorded target_hash without it comes from another scheme and is refused.
TARGET_HASH_PREFIX = "2:"


def target_fingerprint(name_or_path: str) -> str:
    """A hash of a local checkpoint: ``config.json`` and ``generation_config.json`` in full, and every weight file
    (``*.safetensors``, ``*.bin``; a GGUF target's file, :func:`decode.gguf.find_gguf`) by name, size and every byte (sha256: about 1.5 GB/s on one core of this CPU, so
    ~10 s for an 8B bf16 target, once per run). A hub id is hashed as the snapshot its ``refs/main`` points to in the
    local Hugging Face cache (``decode.loading.local_folder``), so a downloaded update of the target is a changed
    target; a hub id not in the cache hashes its name only. Returns ``"2:"`` + 16 hex digits. Every byte, because a
    change confined to the middle of a file (a LoRA merged into a few layers) is still another target.
    """
    h = hashlib.sha256()
    gguf = find_gguf(str(name_or_path), "target")  # a GGUF file (or a folder of one): its every byte
    folder = local_folder(str(name_or_path)) if gguf is None else None
    if gguf is None and folder is None:
        h.update(str(name_or_path).encode())
        return TARGET_HASH_PREFIX + h.hexdigest()[:16]
    path = Path(folder) if folder is not None else gguf.parent
    for name in ("config.json", "generation_config.json"):
        if gguf is None and (path / name).exists():
            h.update(name.encode() + (path / name).read_bytes())
    chunk = 1 << 20
    weights = [gguf] if gguf is not None else sorted(list(path.glob("*.safetensors")) + list(path.glob("*.bin")))
    for f in weights:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            while block := fh.read(16 * chunk):
                h.update(block)
    return TARGET_HASH_PREFIX + h.hexdigest()[:16]
