"""``from_pretrained`` / ``save_pretrained``, and the in-place fill a sharded model uses to read only its slices."""

import dataclasses
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from moe_lightning.model import MoEConfig, MoETransformer
import moe_lightning.hf.fp8 as fp8
from moe_lightning.hf.deepseek import DeepseekV2, DeepseekV3
from moe_lightning.hf.ernie import Ernie45Moe
from moe_lightning.hf.family import Family
from moe_lightning.hf.glm4_moe import Glm4Moe
from moe_lightning.hf.files import SafetensorsDir, read_config, write_directory
from moe_lightning.hf.mapping import Absent, HFFormatError, Source, refuse_non_finite
from moe_lightning.hf.mixtral import Mixtral
from moe_lightning.hf.olmoe import Olmoe
from moe_lightning.hf.qwen3_moe import Qwen3Moe

# Every family (hf.family.Family), in the order choose_family tries them: adding one is its file and a line here.
FAMILIES: dict[str, Family] = {family.ARCHITECTURE: family for family in (
    Mixtral,
    Qwen3Moe,
    Olmoe,
    DeepseekV3,
    DeepseekV2,
    Ernie45Moe,
    Glm4Moe,
)}


def family_of(hf: dict):
    architectures = hf.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in FAMILIES:
        raise HFFormatError(f"config.json architectures={architectures} is not supported: the families read here "
                            f"are {sorted(FAMILIES)}.")
    return FAMILIES[architectures[0]]


def read_hf_config(path: str | Path) -> dict:
    """``config.json``, with ``num_nextn_predict_layers`` as the tensors bear it out: transformers' DeepSeek-V3
    config writes 1 by default while ``save_pretrained`` saves no MTP layer, so a count without the first MTP
    layer's tensors reads as 0, with a warning (a Python user of ``from_pretrained`` sees it, not only ``fit``).
    A ``quantization_config`` other than 128 x 128 block FP8 is refused here, naming its field."""
    hf = read_config(path)
    fp8.block_fp8(hf)
    if hf.get("num_nextn_predict_layers"):
        first = f"model.layers.{hf.get('num_hidden_layers')}.eh_proj.weight"
        if first not in SafetensorsDir(path).keys():
            warnings.warn(f"{str(path)!r}: config.json says num_nextn_predict_layers={hf['num_nextn_predict_layers']} "
                          f"but holds no {first} (transformers writes the count, not the layers): loading without "
                          f"multi-token-prediction layers (mtp_layers=0).", stacklevel=2)
            hf = {**hf, "num_nextn_predict_layers": 0}
    return hf


def load_config(path: str | Path) -> MoEConfig:
    """The ``MoEConfig`` a Hugging Face directory describes (refusing what the model cannot compute)."""
    hf = read_hf_config(path)
    return family_of(hf).config_from_hf(hf)


# Settings of training, not of the released weights: a config given beside ``pretrained`` may change them.
TRAINING_FIELDS = {"bias_update_rate", "aux_loss_coef", "z_loss_coef", "init_std", "max_seq_len",
                   "document_masking", "eod_token_id", "mtp_loss_weight"}


def merge_config(path: str | Path, config: MoEConfig | None = None) -> MoEConfig:
    """The directory's config, keeping from ``config`` only the training settings it sets (``TRAINING_FIELDS``
    not at their default): the shape, every other field, is the checkpoint's whatever ``config`` says, so any
    config (a shipped YAML sized for training from scratch, say) can start from a released model.
    ``replaced_fields`` names what the checkpoint overrode."""
    loaded = load_config(path)
    if config is None:
        return loaded
    default = MoEConfig()  # an instance, so derived defaults (head_dim) count as unset too
    kept = {name: getattr(config, name) for name in sorted(TRAINING_FIELDS)
            if getattr(config, name) != getattr(default, name)}
    return dataclasses.replace(loaded, **kept)


def replaced_fields(config: MoEConfig, merged: MoEConfig) -> list[str]:
    """``name=given -> checkpoint's`` for every field ``config`` set (not at its default) that ``merge_config``
    replaced by the checkpoint's value."""
    default = MoEConfig()
    return [f"{f.name}={getattr(config, f.name)!r} -> {getattr(merged, f.name)!r}" for f in dataclasses.fields(MoEConfig)
            if getattr(config, f.name) != getattr(default, f.name) and getattr(config, f.name) != getattr(merged, f.name)]


def _checked(path: str | Path, shapes: dict[str, torch.Size],
             dtype: torch.dtype | None) -> tuple[MoEConfig, dict[str, Source], SafetensorsDir | fp8.Dequantized]:
    """Config, the source of every tensor, and the files; every name, key and shape checked before any read.
    Block-FP8 weights read dequantised to ``dtype`` (``None``: the dtype the checkpoint's embedding is stored in)."""
    hf = read_hf_config(path)
    family = family_of(hf)
    config = family.config_from_hf(hf)
    sources = family.sources(config, hf)
    if set(shapes) != set(sources):
        raise HFFormatError(f"the model's tensors {sorted(set(shapes) ^ set(sources))[:6]} do not match a "
                            f"{family.ARCHITECTURE} of this config.json: build the model from "
                            f"hf.load_config({str(path)!r}).")
    files = SafetensorsDir(path)
    if fp8.block_fp8(hf):
        files = fp8.Dequantized(files, dtype or files.dtype(sources["tok_embeddings.weight"].key))
        files.check()
    elif scales := sorted(k for k in files.keys() if k.endswith(fp8.SCALE_SUFFIX) or k.endswith(".weight_scale")):
        raise HFFormatError(f"{str(path)!r} holds quantisation scales such as {scales[:3]} but config.json has no "
                            f"quantization_config: add the one the release came with (block FP8: "
                            f"{json.dumps(fp8.QUANTIZATION_CONFIG)}).")
    elif quantized := sorted(k for k in files.keys() if files.dtype(k) == fp8.FP8):
        raise HFFormatError(f"{str(path)!r} holds float8_e4m3fn tensors such as {quantized[:3]} without scales or a "
                            f"quantization_config: their values cannot be dequantised.")
    wanted = {key for source in sources.values() for key in source.keys()}
    present = files.keys()
    if missing := sorted(wanted - present):
        raise HFFormatError(f"{str(path)!r} lacks {len(missing)} tensors that config.json implies, e.g. {missing[:4]}.")
    extra = sorted(k for k in present - wanted if not k.endswith("rotary_emb.inv_freq"))  # derived, never needed
    mtp = [k for k in extra if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m[1]) >= config.n_layers]
    if mtp:
        raise HFFormatError(f"multi-token-prediction layer tensors such as {mtp[:3]} (model.layers.{config.n_layers}.* "
                            f"and beyond) are not supported: remove them from the checkpoint to load the main model.")
    if extra:
        raise HFFormatError(f"{str(path)!r} holds {len(extra)} tensors a {family.ARCHITECTURE} does not use, "
                            f"e.g. {extra[:4]}: they would be dropped, so the checkpoint is refused.")
    for name, source in sources.items():
        source.check(files.shape, tuple(shapes[name]), name)
    return config, sources, files


def _local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's part of ``tensor`` and where it sits in the global tensor."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private, since 2.5
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return tensor, tuple(slice(0, s) for s in tensor.shape)


@torch.no_grad()
def fill_state_dict(state: dict[str, torch.Tensor], path: str | Path,
                    whole_shapes: dict[str, torch.Size] | None = None) -> None:
    """Copy a Hugging Face checkpoint into ``state``'s tensors in place (names as in ``MoETransformer``).

    Plain tensors are read whole; a DTensor reads only its local region: a row shard only its rows, an
    expert shard only the per-expert tensors of its experts. This is the seam a sharding strategy calls. A block-FP8
    region is dequantised in float32 from the blocks it touches, then cast into the tensor's dtype.
    ``whole_shapes``: the whole model's tensors, when ``state`` holds some of them (a pipeline stage's): the release
    is checked against all of them (so every rank refuses a bad one alike) and only ``state``'s are read.
    """
    shapes = {name: t.shape for name, t in state.items()}
    if whole_shapes is not None:
        if stray := sorted(set(shapes) - set(whole_shapes)):
            raise ValueError(f"fill_state_dict: {stray[:4]} are not among the whole model's tensors")
        shapes = dict(whole_shapes)
    _, sources, files = _checked(path, shapes, torch.float32)
    for name, tensor in state.items():
        local, index = _local_region(tensor)
        if local.numel():
            local.copy_(sources[name].read(files.get, index))


# config.json keys a family's ``config_to_hf`` does not write but a release relies on: a Kimi K2 folder is
# ``model_type: kimi_k2`` with ``auto_map`` naming its code, read as DeepseekV3ForCausalLM. Kept on export only with
# that code beside them: without it transformers refuses ``kimi_k2`` but reads the family's own ``deepseek_v3``.
KEPT_KEYS = ("model_type", "auto_map")


def kept_keys(hf: dict, folder: str | Path | None = None) -> dict:
    """What an export of a model loaded from ``hf`` (config.json of ``folder``) keeps of it: ``KEPT_KEYS``, the
    architecture they belong with (``write_pretrained`` applies them only to that architecture) and, when ``auto_map``
    names code, the text of the folder's top-level ``.py`` files as ``code`` (read as text, never imported)."""
    kept = {"architectures": hf.get("architectures"), **{k: hf[k] for k in KEPT_KEYS if k in hf}}
    if "auto_map" in hf and folder is not None:
        kept["code"] = {file.name: file.read_text() for file in sorted(Path(folder).glob("*.py")) if file.is_file()}
    return kept


def _code_files(auto_map: dict) -> set[str]:
    """The files an ``auto_map`` names (``"module.Class"`` -> ``module.py``; a tokenizer's entry is a list, one
    item may be None). A reference into another repository (``"repo--module.Class"``) names no file that can travel
    with the model: it is kept as is, so it is never found."""
    references = [ref for value in auto_map.values() for ref in (value if isinstance(value, list) else [value]) if ref]
    return {ref if "--" in ref else ref.rsplit(".", 1)[0] + ".py" for ref in references}


def _apply_kept(hf_config: dict, kept: dict | None) -> dict[str, str]:
    """Puts ``kept``'s ``model_type`` and ``auto_map`` into ``hf_config`` when it is the architecture they came with
    and every code file ``auto_map`` names travels too; returns those files (name -> text). Otherwise the family's
    own ``model_type`` stays (one warning naming what was dropped and why)."""
    if not kept or kept.get("architectures") != hf_config["architectures"]:
        return {}
    code = kept.get("code") or {}
    missing = sorted(_code_files(kept["auto_map"]) - set(code)) if "auto_map" in kept else []
    if "auto_map" in kept and not missing:
        hf_config.update({k: kept[k] for k in KEPT_KEYS if k in kept})
        return code
    dropped = {k: kept[k] for k in KEPT_KEYS if k in kept and kept[k] != hf_config.get(k)}
    if dropped:
        why = (f"the code it names ({', '.join(missing)}) is not with the model: the folder it came from no longer "
               "holds it" if missing else "it names no code for that model_type")
        warnings.warn(f"config.json written with model_type {hf_config['model_type']!r}, dropping {dropped}: {why}.",
                      stacklevel=3)
    return {}


class OpenPretrained:
    """A Hugging Face directory opened for reading one of our tensors at a time, every name, key and shape checked
    first: ``names`` (``MoETransformer``'s), ``shape(name)``, ``dtype(name)`` (known before the read) and
    ``read(name)``.

    ``dtype=None`` keeps every tensor's stored dtype, except the balancing bias: the router updates and computes it
    in float32 (a step of 1e-3 vanishes in bf16 at magnitude ~4), so a lower-precision bias is widened and its
    stored dtype is kept in ``widened`` (for a writer to store it back bit-identically). Otherwise floating tensors
    are cast to ``dtype`` and the bias is float32. Block-FP8 weights are dequantised (weight x scale_inv in float32)
    into ``fp8_dtype``, or with ``None`` into ``dtype`` or, that None too, the dtype the checkpoint stores its
    embedding in (bf16 for the releases), as DeepSeek's own conversion does."""

    def __init__(self, path: str | Path, dtype: torch.dtype | None = None, fp8_dtype: torch.dtype | None = None):
        self.hf = read_hf_config(path)
        self.config = family_of(self.hf).config_from_hf(self.hf)
        with torch.device("meta"):
            shapes = {name: t.shape for name, t in MoETransformer(self.config).state_dict().items()}
        self.names, self._shapes, self._dtype = list(shapes), shapes, dtype
        _, self._sources, self._files = _checked(path, shapes, fp8_dtype or (None if dtype is None else torch.float32))
        self.widened: dict[str, torch.dtype] = {}

    def shape(self, name: str) -> torch.Size:
        return self._shapes[name]

    def _convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("expert_bias"):
            if self._dtype is None and tensor.dtype != torch.float32:
                self.widened[name] = tensor.dtype
            return tensor.float()
        return tensor.to(self._dtype) if self._dtype is not None and tensor.is_floating_point() else tensor

    def dtype(self, name: str) -> torch.dtype:
        """From a read of at most one element."""
        corner = tuple(slice(0, min(1, s)) for s in self._shapes[name])
        return self._convert(name, self._sources[name].read(self._files.get, corner)).dtype

    def read(self, name: str) -> torch.Tensor:
        whole = tuple(slice(0, s) for s in self._shapes[name])
        return self._convert(name, self._sources[name].read(self._files.get, whole))


@torch.no_grad()
def from_pretrained(path: str | Path, dtype: torch.dtype | None = None) -> MoETransformer:
    """Build the model a Hugging Face directory describes and load its weights, in the dtypes
    :class:`OpenPretrained` reads them; ``model.stored_dtypes`` records the tensors held wider than stored (the
    balancing bias), so ``save_pretrained`` writes them back bit-identically."""
    opened = OpenPretrained(path, dtype)
    config = opened.config
    state = {name: opened.read(name) for name in opened.names}
    with torch.device("meta"):
        model = MoETransformer(config)
    if config.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, assign=True)
    if config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    if left := [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]:
        raise HFFormatError(f"from_pretrained left {left[:4]} unloaded (not in the state dict).")
    model.stored_dtypes = opened.widened
    return model


def stored_dtype_getter(get: Callable[[str], torch.Tensor],
                        stored: dict[str, torch.dtype]) -> Callable[[str], torch.Tensor]:
    """``get``, casting the tensors ``from_pretrained`` widened back to the dtype the checkpoint stored."""
    return lambda name: get(name).to(stored[name]) if name in stored else get(name)


def choose_family(config: MoEConfig, architecture: str | None = None,
                  get: Callable[[str], torch.Tensor] | None = None):
    """The named family, or the first kind of checkpoint that can hold ``config`` and, when ``get`` gives the
    tensors, their values: one without a balancing-bias slot only if the bias stays zero (``bias_update_rate`` 0)."""
    if architecture is not None:
        if architecture not in FAMILIES:
            raise HFFormatError(f"architecture={architecture!r} is not supported: choose one of {sorted(FAMILIES)}.")
        FAMILIES[architecture].config_to_hf(config)
        return FAMILIES[architecture]
    reasons = []
    for family in FAMILIES.values():
        try:
            family.config_to_hf(config)
            for name, source in family.sources(config).items():
                if isinstance(source, Absent) and name.endswith("expert_bias") and config.bias_update_rate > 0:
                    raise HFFormatError(f"{family.ARCHITECTURE} has no slot for the balancing bias {name}, which "
                                        f"bias_update_rate={config.bias_update_rate} trains")
                if isinstance(source, Absent) and get is not None:
                    source.write(get(name), name)  # refuses a non-zero tensor
            return family
        except HFFormatError as err:
            reasons.append(str(err))
    raise HFFormatError("no Hugging Face family can hold this model:\n  " + "\n  ".join(reasons))


def write_pretrained(config: MoEConfig, get: Callable[[str], torch.Tensor], path: str | Path,
                     architecture: str | None = None, max_shard_bytes: int = 5 * 2**30,
                     files: dict[str, str] | None = None, fp8_blocks: bool = False, kept: dict | None = None) -> Path:
    """Write a Hugging Face directory, asking ``get(name)`` for one of our tensors at a time (streaming); ``files``
    (name -> text, e.g. the tokenizer's) go in with it. ``fp8_blocks`` writes the tensors the DeepSeek-V3 and Kimi K2
    releases store in FP8 (``fp8.quantized``) as 128 x 128 blocks with their ``*_scale_inv``, and says so in
    ``quantization_config``. A tensor holding inf or NaN is refused, naming it (nothing is written: the folder is
    committed only once complete). ``kept`` (``kept_keys`` of the folder the model was loaded from) puts back that
    folder's ``model_type`` and ``auto_map``, with the code files ``auto_map`` names, when writing the same
    architecture and that code is there to copy."""
    family = choose_family(config, architecture, get)
    hf_config = family.config_to_hf(config)
    files = {**(files or {}), **_apply_kept(hf_config, kept)}
    if fp8_blocks:
        hf_config["quantization_config"] = dict(fp8.QUANTIZATION_CONFIG)
    sources = family.sources(config)
    for name, source in sources.items():  # cheap refusals first: a non-zero bias the format cannot hold
        if isinstance(source, Absent):
            source.write(get(name), name)

    def tensors():
        written = set()
        for name, source in sources.items():
            for key, tensor in source.write(refuse_non_finite(get(name), name), name).items():
                if key in written:  # a tied head is the embedding
                    continue
                written.add(key)
                if fp8_blocks and fp8.quantized(name):
                    weight, scale = fp8.quantize(tensor, key)
                    yield key, weight
                    yield key + fp8.SCALE_SUFFIX, scale
                else:
                    yield key, tensor
    return write_directory(path, hf_config, tensors(), max_shard_bytes, files)


def save_pretrained(model: MoETransformer, path: str | Path, architecture: str | None = None,
                    max_shard_bytes: int = 5 * 2**30, fp8_blocks: bool = False) -> Path:
    """Write ``config.json`` and safetensors shards (+ index) that ``transformers`` loads as ``architecture``
    (``fp8_blocks``: in the block-FP8 release format, see ``write_pretrained``)."""
    get = stored_dtype_getter(model.state_dict().__getitem__, getattr(model, "stored_dtypes", {}))
    return write_pretrained(model.config, get, path, architecture, max_shard_bytes, fp8_blocks=fp8_blocks)
