"""How one of our tensors is made from Hugging Face tensors, and back; the pieces every family shares.

A :class:`Source` reads any rectangular region of one of our (global) tensors from the checkpoint, so a
rank that holds a shard reads only that shard's rows (or only its experts), and writes the whole tensor
back as the Hugging Face tensors it came from. No transposes: ``nn.Linear`` is ``[out, in]`` on both sides.
"""

from collections.abc import Callable

import torch

from moe_lightning.model import MoEConfig

Index = tuple[slice, ...]
Getter = Callable[[str], object]  # key -> something sliceable like safetensors' ``get_slice``


class HFFormatError(ValueError):
    """A Hugging Face checkpoint or target format cannot represent something; the message names it and the fix."""


class Source:
    """One of our tensors, as a function of checkpoint tensors."""

    def keys(self) -> list[str]:
        return []

    def check(self, shape_of: Callable[[str], tuple[int, ...]], shape: tuple[int, ...], name: str) -> None:
        """Raise before any read if the checkpoint's shapes cannot make a ``shape`` tensor."""

    def read(self, get: Getter, index: Index) -> torch.Tensor:
        raise NotImplementedError

    def write(self, tensor: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        raise NotImplementedError


# Values checked at a time: ``torch.isfinite`` builds the ``abs()`` of what it is given and two masks, so checking a
# whole tensor at once would need more than the tensor again (1 Mi float32 values: 4 MiB + 3 MiB at a time).
NON_FINITE_CHUNK = 2**20


def refuse_non_finite(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor``, unless it holds inf or NaN: an export would carry a diverged run's values silently (every reader
    loads them without a word), so writing one is refused, naming the tensor. A contiguous tensor is checked
    ``NON_FINITE_CHUNK`` values at a time."""
    if not tensor.is_floating_point():
        return tensor
    chunks = tensor.view(-1).split(NON_FINITE_CHUNK) if tensor.is_contiguous() else (tensor,)
    bad = sum(chunk.numel() - int(torch.isfinite(chunk).sum()) for chunk in chunks)
    if bad:
        raise HFFormatError(f"{name} holds {bad} non-finite value(s) (inf or NaN) of {tensor.numel()}: refusing to "
                            f"write it; export a checkpoint saved before the run diverged.")
    return tensor


def _shape_error(name: str, key: str, found, expected) -> HFFormatError:
    return HFFormatError(f"checkpoint tensor {key!r} has shape {tuple(found)}, but {name} needs {tuple(expected)}: "
                         f"config.json does not describe these weights.")


class Copy(Source):
    def __init__(self, key: str):
        self.key = key

    def keys(self) -> list[str]:
        return [self.key]

    def check(self, shape_of, shape, name) -> None:
        if tuple(shape_of(self.key)) != tuple(shape):
            raise _shape_error(name, self.key, shape_of(self.key), shape)

    def read(self, get, index):
        return get(self.key)[index]

    def write(self, tensor, name):
        return {self.key: tensor}


class Shared(Copy):
    """One of our tensors that the checkpoint repeats under ``copies`` (DeepSeek-V3's MTP layers store the shared
    embedding and head again): read from ``key``, the same region checked equal in every copy, written to all."""

    def __init__(self, key: str, copies: list[str]):
        super().__init__(key)
        self.copies = copies

    def keys(self) -> list[str]:
        return [self.key, *self.copies]

    def check(self, shape_of, shape, name) -> None:
        for key in self.keys():
            Copy(key).check(shape_of, shape, name)

    def read(self, get, index):
        tensor = get(self.key)[index]
        for key in self.copies:
            if not torch.equal(get(key)[index], tensor):
                raise HFFormatError(f"checkpoint tensor {key!r} differs from {self.key!r}: the multi-token "
                                    f"prediction layers share the main model's embedding and output head here (as "
                                    f"DeepSeek-V3 trains them), so they cannot load separate copies.")
        return tensor

    def write(self, tensor, name):
        return {key: tensor for key in self.keys()}


class Rows(Copy):
    """``ours[i] = hf[perm[i]]`` along dim 0: the rotary layout change of half-split families."""

    def __init__(self, key: str, perm: torch.Tensor):
        super().__init__(key)
        self.perm = perm

    def read(self, get, index):
        rows = self.perm[index[0]]
        lo, hi = int(rows.min()), int(rows.max()) + 1  # the heads this region touches, no more
        return get(self.key)[(slice(lo, hi), *index[1:])][rows - lo]

    def write(self, tensor, name):
        return {self.key: tensor[self.perm.argsort()]}


class Stack(Source):
    """``ours[e] = hf[keys[e]]``: per-expert matrices stacked into ``[E, out, in]``."""

    def __init__(self, keys: list[str]):
        self._keys = keys

    def keys(self) -> list[str]:
        return list(self._keys)

    def check(self, shape_of, shape, name) -> None:
        if len(self._keys) != shape[0]:
            raise HFFormatError(f"{name} stacks {shape[0]} experts but the mapping names {len(self._keys)}.")
        for key in self._keys:
            if tuple(shape_of(key)) != tuple(shape[1:]):
                raise _shape_error(name, key, shape_of(key), shape[1:])

    def read(self, get, index):
        """Filled one expert at a time: the region plus one expert in memory, not twice the region."""
        experts = range(*index[0].indices(len(self._keys)))
        out = None
        for i, e in enumerate(experts):
            piece = get(self._keys[e])[index[1:]]
            if out is None:
                out = piece.new_empty((len(experts), *piece.shape))
            out[i] = piece
        return out

    def write(self, tensor, name):
        return {key: tensor[e] for e, key in enumerate(self._keys)}


class Absent(Source):
    """A buffer the format has no slot for: loads as zeros, and saving refuses anything else."""

    def __init__(self, architecture: str, fix: str):
        self.architecture, self.fix = architecture, fix

    def read(self, get, index):
        return torch.zeros([s.stop - s.start for s in index], dtype=torch.float32)

    def write(self, tensor, name):
        if torch.count_nonzero(tensor):
            raise HFFormatError(f"{name} is non-zero but {self.architecture} has no slot for it: {self.fix}.")
        return {}


def no_bias_slot(architecture: str) -> Absent:
    """``config_from_hf`` sets ``bias_update_rate=0`` for these families, so training leaves the bias at zero. A
    model that routes with this family's softmax cannot be saved as DeepSeek-V3 either (sigmoid routing)."""
    return Absent(architecture, "train with bias_update_rate=0 (the default for a model loaded from this "
                                "format), so the bias stays zero")


def half_split_perm(n_heads: int, head_dim: int) -> torch.Tensor:
    """Row order taking half-split rotary pairs ``(j, j + K/2)`` to our interleaved ``(2j, 2j + 1)``, per head."""
    half = head_dim // 2
    per_head = torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()
    return (per_head + head_dim * torch.arange(n_heads)[:, None]).flatten()


# ---- config helpers shared by the families ------------------------------------------------------------

def rope_parameters(hf: dict) -> dict:
    """Rotary parameters as transformers 5 reads them: an old-style ``rope_scaling`` replaces ``rope_parameters``
    (not merged), a top-level ``rope_theta`` (or the family default) fills a missing theta, and ``rope_type``
    wins over the legacy ``type``."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if params.get("rope_theta") is None:
        params["rope_theta"] = field(hf, "rope_theta")
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_fields(hf: dict) -> dict:
    """Our rotary fields from the config: plain or YaRN (read as transformers reads them); others refused."""
    params = rope_parameters(hf)
    fields = {"rope_theta": float(params["rope_theta"])}
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFFormatError(f"config.json partial_rotary_factor={params['partial_rotary_factor']} is not supported: "
                            f"every query/key dim is rotated here.")
    if params["rope_type"] == "default":
        return fields
    if params["rope_type"] != "yarn":
        raise HFFormatError(f"config.json rope_scaling type {params['rope_type']!r} is not supported: only 'yarn' "
                            f"(or no scaling) is implemented.")
    # transformers gives a top-level original_max_position_embeddings priority over the one in rope_scaling
    original = (hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                or hf["max_position_embeddings"])
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    return {**fields, "rope_scaling": "yarn", "rope_factor": float(factor), "rope_original_max_seq_len": int(original),
            "rope_beta_fast": float(params.get("beta_fast") or 32),
            "rope_beta_slow": float(params.get("beta_slow") or 1),
            "rope_mscale": float(params.get("mscale") or 0),  # transformers treats a missing mscale as off
            "rope_mscale_all_dim": float(params.get("mscale_all_dim") or 0),
            "rope_attention_factor": params.get("attention_factor"),
            "rope_truncate": bool(params.get("truncate", True))}


def rope_to_hf(config: MoEConfig) -> dict:
    """Top-level ``rope_theta`` + ``rope_scaling``: what released configs use and every reader understands."""
    if config.rope_scaling != "yarn":
        return {"rope_theta": config.rope_theta, "rope_scaling": None}
    scaling = {"type": "yarn", "rope_type": "yarn", "factor": config.rope_factor,
               "original_max_position_embeddings": config.rope_original_max_seq_len,
               "beta_fast": config.rope_beta_fast, "beta_slow": config.rope_beta_slow, "mscale": config.rope_mscale,
               "mscale_all_dim": config.rope_mscale_all_dim, "truncate": config.rope_truncate}
    if config.rope_attention_factor is not None:
        scaling["attention_factor"] = config.rope_attention_factor
    return {"rope_theta": config.rope_theta, "rope_scaling": scaling}


def field(hf: dict, *names: str, nullable: bool = False):
    """The first of ``names`` config.json has (transformers renames some on save, e.g. ``num_local_experts``);
    ``nullable`` accepts an explicit ``null`` (e.g. ``q_lora_rank: null`` for full-rank queries)."""
    for name in names:
        if hf.get(name) is not None or (nullable and name in hf):
            return hf[name]
    raise HFFormatError(f"config.json lacks {' / '.join(names)} (absent or null): the file is incomplete for this "
                        f"architecture, which has no default for it that the weights could rely on; add the key.")


def with_defaults(hf: dict, defaults: dict) -> dict:
    """``config.json`` with absent keys taken from the family's transformers config class, as transformers
    reads it (an explicit ``null`` stays). ``tests/hf/test_mapping.py`` checks each table against transformers."""
    return {**defaults, **hf}


def refuse(hf: dict, field: str, bad: Callable[[object], bool], why: str) -> None:
    if bad(hf.get(field)):
        raise HFFormatError(f"config.json {field}={hf.get(field)!r} is not supported: {why}.")


def refuse_common(hf: dict) -> None:
    """What no family here supports: other activations, biases, sliding windows (only Qwen3-MoE gates
    ``sliding_window`` with ``use_sliding_window``; it handles that itself). ``quantization_config`` is read by
    ``hf.fp8``."""
    refuse(hf, "hidden_act", lambda v: v not in (None, "silu"), "the experts and FFNs are SwiGLU (hidden_act='silu')")
    refuse(hf, "attention_bias", bool, "attention projections have no biases here")
    refuse(hf, "mlp_bias", bool, "FFN projections have no biases here")
    refuse(hf, "sliding_window", lambda v: v is not None, "sliding-window attention is not implemented; "
           "set it to null only if the model was trained with full attention")


def check_representable(config: MoEConfig, architecture: str, **required) -> None:
    """Refuse to write ``architecture`` unless each named config field has the required value."""
    for field, want in required.items():
        have = getattr(config, field)
        if have != want:
            raise HFFormatError(f"MoEConfig.{field}={have!r} cannot be written as {architecture}, which needs "
                                f"{field}={want!r}: choose another architecture (or change the model).")


def common_config(hf: dict) -> dict:
    """Fields every family spells the same way (``hf`` already holds the family's defaults)."""
    return dict(vocab_size=field(hf, "vocab_size"), dim=field(hf, "hidden_size"),
                n_layers=field(hf, "num_hidden_layers"), n_heads=field(hf, "num_attention_heads"),
                max_seq_len=field(hf, "max_position_embeddings"), norm_eps=field(hf, "rms_norm_eps"),
                tie_embeddings=bool(hf.get("tie_word_embeddings")), **rope_fields(hf))


def gqa_config(hf: dict) -> dict:
    """``common_config`` plus the GQA head layout; ``num_key_value_heads: null`` means one per query head."""
    fields = common_config(hf)
    return dict(fields, n_kv_heads=field(hf, "num_key_value_heads", nullable=True) or fields["n_heads"],
                head_dim=hf.get("head_dim"))


MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)  # formats with multi-token prediction layers


def common_to_hf(config: MoEConfig, architecture: str, model_type: str) -> dict:
    if config.mtp_layers and architecture not in MTP_ARCHITECTURES:
        raise HFFormatError(f"MoEConfig.mtp_layers={config.mtp_layers} cannot be written as {architecture}, which has "
                            f"no multi-token prediction layers: use one of {list(MTP_ARCHITECTURES)}, or export a "
                            f"model built with mtp_layers=0 (e.g. convert to .pt and drop the mtp.* tensors).")
    return {"architectures": [architecture], "model_type": model_type, "vocab_size": config.vocab_size,
            "hidden_size": config.dim, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, **rope_to_hf(config)}


# ---- tensor maps shared by the families --------------------------------------------------------------

def outer_sources(config: MoEConfig) -> dict[str, Source]:
    """Embedding, final norm and head (a tied head is the embedding)."""
    return {"tok_embeddings.weight": Copy("model.embed_tokens.weight"), "norm.weight": Copy("model.norm.weight"),
            "output.weight": Copy("model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight")}


def gqa_sources(config: MoEConfig, p: str, half_split: bool) -> dict[str, Source]:
    """``self_attn.{q,k,v,o}_proj``; q and k rows reordered per head for half-split rotary layouts."""
    rows = (lambda key, heads: Rows(key, half_split_perm(heads, config.head_dim))) if half_split else \
        (lambda key, heads: Copy(key))
    return {"attention.wq.weight": rows(f"{p}self_attn.q_proj.weight", config.n_heads),
            "attention.wk.weight": rows(f"{p}self_attn.k_proj.weight", config.n_kv_heads),
            "attention.wv.weight": Copy(f"{p}self_attn.v_proj.weight"),
            "attention.wo.weight": Copy(f"{p}self_attn.o_proj.weight")}


def swiglu_sources(ours: str, hf: str, names=("gate_proj", "up_proj", "down_proj")) -> dict[str, Source]:
    """Our ``w1/w3/w2`` (gate, up, down) of a dense FFN or shared expert."""
    return {f"{ours}.{w}.weight": Copy(f"{hf}.{n}.weight") for w, n in zip(("w1", "w3", "w2"), names)}


def expert_sources(config: MoEConfig, hf: str, names=("gate_proj", "up_proj", "down_proj")) -> dict[str, Source]:
    """Per-expert ``{hf}.{e}.{gate,up,down}.weight`` stacked into ``w1_EFD``, ``w3_EFD``, ``w2_EDF``."""
    E = config.num_experts
    return {f"ffn.experts.{w}": Stack([f"{hf}.{e}.{n}.weight" for e in range(E)])
            for w, n in zip(("w1_EFD", "w3_EFD", "w2_EDF"), names)}


def layer_sources(config: MoEConfig, i: int, attention: dict[str, Source], moe: Callable[[str], dict],
                  ours: str | None = None, is_moe: bool | None = None) -> dict:
    """One block ``model.layers.{i}`` as ours ``layers.{i}`` (or ``ours``): norms, attention, and a dense FFN
    (``mlp.*_proj``) or the family's MoE layer (``is_moe``, default: as the config says for block ``i``)."""
    p = f"model.layers.{i}."
    out = {"attention_norm.weight": Copy(f"{p}input_layernorm.weight"),
           "ffn_norm.weight": Copy(f"{p}post_attention_layernorm.weight"), **attention}
    out.update(moe(p) if (config.is_moe_layer(i) if is_moe is None else is_moe) else swiglu_sources("ffn", f"{p}mlp"))
    return {f"{ours or f'layers.{i}'}.{k}": v for k, v in out.items()}
