"""Hugging Face checkpoints in and out, against ``transformers``' own implementations (tiny random models,
no downloads). Weights are drawn with std 0.3 and norm weights around 1 so attention and routing are far from
uniform (logits are O(1)); a mapping mistake then moves logits by O(1), far above the 1e-4 tolerance, which
only has to absorb float32 summation-order differences (~5e-6 observed)."""

import dataclasses
import glob
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers  # the test extra provides it: a skip would hide every reference test here
import yaml
from safetensors.torch import load_file, save_file

from moe_lightning import MoEConfig, MoELanguageModel, hf
from moe_lightning.commands import main as commands
from moe_lightning.planner.flops import parameter_counts
from moe_lightning.hf import HFFormatError
from moe_lightning.hf.files import SafetensorsDir
from moe_lightning.model import ConfigError, MoETransformer

from tests.support.distributed import REPO_ROOT, run_ranks

COMMON = dict(vocab_size=320, hidden_size=32, num_attention_heads=4, num_experts_per_tok=2)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=16,
           intermediate_size=48, n_routed_experts=8, num_hidden_layers=2, first_k_dense_replace=1,
           rms_norm_eps=1e-5)  # not the latent norms' fixed 1e-6, so mapping one to the other shows
YARN_40 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
           "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek-V3's published rope_scaling
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",  # blocks 0 and 2 dense (sparse step 2), 3 listed dense
                  dict(intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4, num_key_value_heads=2,
                       head_dim=16, num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True,
                       max_position_embeddings=64,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=16, num_hidden_layers=2, num_key_value_heads=2, num_experts=4, clip_qkv=1.5)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(**MLA, q_lora_rank=16, n_group=4, topk_group=2, n_shared_experts=1, num_mtp_layers=0,
                         routed_scaling_factor=2.5, max_position_embeddings=163840, rope_scaling=YARN_40)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",  # V2-Lite-like: full-rank queries
                    dict(**MLA, q_lora_rank=None, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                         n_shared_experts=2, routed_scaling_factor=1.5)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",  # tiny.yaml's kind: softmax + bias + shared
                     dict(intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, num_key_value_heads=2,
                          moe_num_experts=4, moe_num_shared_experts=1, moe_layer_start_index=1,
                          tie_word_embeddings=False)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",  # small.yaml's kind: GQA with V3's sigmoid router
                 dict(intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, num_key_value_heads=2,
                      n_routed_experts=8, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                      routed_scaling_factor=2.5, partial_rotary_factor=1.0)),
}
BIAS_SLOT = ("deepseek_v3", "ernie4_5_moe", "glm4_moe")  # families that store the balancing bias
BIAS_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Ernie4_5_MoeForCausalLM", "Glm4MoeForCausalLM")


def build_reference(name: str, dtype=torch.float32, **overrides):
    config_cls, model_cls, kwargs = FAMILIES[name]
    torch.manual_seed(0)
    hf_config = getattr(transformers, config_cls)(**COMMON, **{**kwargs, **overrides})
    model = getattr(transformers, model_cls)(hf_config).eval()
    with torch.no_grad():
        for key, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if key.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
            elif key.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * torch.randn_like(tensor))  # a real balancing bias, so it must be mapped
            elif tensor.is_floating_point() and tensor.ndim >= 2:
                tensor.normal_(0, 0.3)
    return model.to(dtype)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, its save_pretrained directory)."""
    ref = build_reference(request.param)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return request.param, ref, path


def tokens(n: int = 12) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (2, n), generator=torch.Generator().manual_seed(1))


def safetensors_of(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in glob.glob(f"{path}/*.safetensors"):
        out.update(load_file(file))
    return out


@torch.no_grad()
def test_transformers_to_ours_same_logits_and_greedy_tokens(family):
    name, ref, path = family
    ours = hf.from_pretrained(path, dtype=torch.float32)
    logits = ref(tokens()).logits
    assert logits.abs().mean() > 0.5  # O(1) logits: the test is sensitive to mapping mistakes
    torch.testing.assert_close(ours(tokens()), logits, atol=1e-4, rtol=0)
    greedy_ref = ref.generate(tokens(6), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(tokens(6), 6, temperature=0), greedy_ref)


@torch.no_grad()
def test_ours_to_transformers_loads_without_missing_keys(family, tmp_path):
    name, ref, path = family
    ours = hf.from_pretrained(path, dtype=torch.float32)
    out = hf.save_pretrained(ours, tmp_path / "out", max_shard_bytes=64 * 2**10)  # several shards + index
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(reloaded) is type(ref)  # the architecture was chosen from the config alone
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    torch.testing.assert_close(reloaded.eval()(tokens()).logits, ours(tokens()), atol=1e-4, rtol=0)


def test_checkpoint_to_ours_to_checkpoint_is_bitwise(family, tmp_path):
    name, ref, path = family
    original = safetensors_of(path)
    written = safetensors_of(hf.save_pretrained(hf.from_pretrained(path), tmp_path / "out"))
    assert set(written) == set(original)
    for key, tensor in original.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key


def test_bfloat16_checkpoint_keeps_its_dtype_bitwise(tmp_path):
    """bf16 weights stay bf16; the bf16 balancing bias is held in float32 (a 1e-3 update vanishes in bf16 at
    magnitude ~4) and written back as bf16, by save_pretrained and through a converted .pt."""
    ref = build_reference("deepseek_v3", torch.bfloat16)
    ref.save_pretrained(tmp_path / "bf16")
    ours = hf.from_pretrained(tmp_path / "bf16")
    assert ours.layers[1].ffn.experts.w1_EFD.dtype == torch.bfloat16
    assert ours.layers[1].ffn.router.expert_bias.dtype == torch.float32
    original = safetensors_of(tmp_path / "bf16")
    assert original["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.bfloat16
    commands.run(["convert", str(tmp_path / "bf16"), "--out", str(tmp_path / "model.pt")])
    commands.run(["convert", str(tmp_path / "model.pt"), "--out", str(tmp_path / "back")])
    for written in (safetensors_of(hf.save_pretrained(ours, tmp_path / "out")), safetensors_of(tmp_path / "back")):
        assert set(original) == set(written)
        for key, tensor in original.items():
            assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key


@torch.no_grad()
def test_deepseek_half_split_rope_rows_are_reordered(tmp_path):
    """``rope_interleave: false`` rotates half-split pairs of the rope dims: import re-orders those rows only."""
    ref = build_reference("deepseek_v3")
    ref.config.rope_interleave = False
    ref.save_pretrained(tmp_path / "src")
    ours = hf.from_pretrained(tmp_path / "src", dtype=torch.float32)
    torch.testing.assert_close(ours(tokens()), ref(tokens()).logits, atol=1e-4, rtol=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf.save_pretrained(ours, tmp_path / "out")).eval()
    assert reloaded.config.rope_interleave  # written in our (interleaved) layout, and says so
    torch.testing.assert_close(reloaded(tokens()).logits, ours(tokens()), atol=1e-4, rtol=0)


@torch.no_grad()
def test_tied_embeddings_load_tied_and_save_without_lm_head(tmp_path):
    ref = build_reference("olmoe", tie_word_embeddings=True)
    ref.save_pretrained(tmp_path / "src")
    ours = hf.from_pretrained(tmp_path / "src", dtype=torch.float32)
    assert ours.output.weight is ours.tok_embeddings.weight
    logits = ref(tokens()).logits
    assert logits.abs().mean() > 0.5
    torch.testing.assert_close(ours(tokens()), logits, atol=1e-4, rtol=0)
    assert "lm_head.weight" not in safetensors_of(hf.save_pretrained(ours, tmp_path / "out"))


def test_latent_norms_keep_their_own_eps(tmp_path):
    """transformers' MLA latent norms use 1e-6 whatever rms_norm_eps says (1e-5 in the test configs)."""
    for name in ("deepseek_v3", "deepseek_v2"):
        build_reference(name).save_pretrained(tmp_path / name)
        config = hf.load_config(tmp_path / name)
        assert (config.norm_eps, config.mla_norm_eps) == (1e-5, 1e-6), name


def test_any_region_reads_as_that_slice_of_the_whole(family):
    """What a shard reads (rows of re-ordered q/k, some experts and columns) equals slicing the full tensor."""
    name, ref, path = family
    hf_config = json.loads((path / "config.json").read_text())
    arch = hf.FAMILIES[hf_config["architectures"][0]]
    config = arch.config_from_hf(hf_config)
    with torch.device("meta"):
        shapes = {k: t.shape for k, t in MoETransformer(config).state_dict().items()}
    files, generator = SafetensorsDir(path), torch.Generator().manual_seed(0)
    for tensor_name, source in arch.sources(config, hf_config).items():
        whole = source.read(files.get, tuple(slice(0, n) for n in shapes[tensor_name]))
        starts = [int(torch.randint(0, n, (), generator=generator)) for n in whole.shape]
        region = tuple(slice(lo, int(torch.randint(lo + 1, n + 1, (), generator=generator)))
                       for lo, n in zip(starts, whole.shape))
        assert torch.equal(source.read(files.get, region), whole[region]), tensor_name


# Each changes one mapped feature and must change the logits: the test configs really exercise it.
FEATURES = [("deepseek_v3", dict(rope_scaling="none", rope_factor=1.0)),
            ("qwen3_moe", dict(rope_scaling="none", rope_factor=1.0)),
            ("deepseek_v3", dict(n_expert_groups=1, n_limited_groups=1)), ("deepseek_v3", dict(group_score="max")),
            ("deepseek_v2", dict(group_score="top2_sum")), ("deepseek_v3", dict(route_scale=1.0)),
            ("olmoe", dict(clip_qkv=None)), ("qwen3_moe", dict(route_norm=False)), ("deepseek_v3", "zero bias")]


@pytest.mark.parametrize("name,change", FEATURES, ids=[f"{n}-{c if isinstance(c, str) else ','.join(c)}"
                                                         for n, c in FEATURES])
@torch.no_grad()
def test_features_are_exercised(name, change, tmp_path):
    build_reference(name).save_pretrained(tmp_path)
    ours = hf.from_pretrained(tmp_path, dtype=torch.float32)
    state = ours.state_dict()
    if change == "zero bias":
        config = ours.config
        state = {k: torch.zeros_like(v) if k.endswith("expert_bias") else v for k, v in state.items()}
    else:
        config = MoEConfig(**{**ours.config.__dict__, **change})
    with torch.device("meta"):
        changed = MoETransformer(config)
    changed.load_state_dict(state, assign=True)
    assert (changed(tokens()) - ours(tokens())).abs().max() > 1e-2


def test_group_rules_rank_groups_differently():
    """V3 ranks groups by the sum of their best two scores, V2 by their best score."""
    scores_TE = torch.tensor([[0.9, 0.0, 0.5, 0.5]])  # group 0: best 0.9, top-2 sum 0.9; group 1: 0.5 and 1.0
    kept = {}
    for rule in ("top2_sum", "max"):
        router = MoETransformer(MoEConfig(num_experts=4, top_k=1, n_expert_groups=2, n_limited_groups=1,
                                          group_score=rule, n_layers=1, n_dense_layers=0)).layers[0].ffn.router
        kept[rule] = router._mask_unselected_groups(scores_TE).isfinite()[0].tolist()
    assert kept == {"top2_sum": [False, False, True, True], "max": [True, True, False, False]}


def test_dense_layer_pattern():
    pattern = MoEConfig(n_layers=4, n_dense_layers=0, dense_layers=[3, 1])
    assert pattern.dense_layers == [1, 3] and pattern.n_moe_layers == 2
    assert [b.is_moe for b in MoETransformer(pattern).layers] == [True, False, True, False]
    assert parameter_counts(pattern) == parameter_counts(MoEConfig(n_layers=4, n_dense_layers=2))
    for bad in (dict(dense_layers=[1]), dict(n_dense_layers=0, dense_layers=[4]),
                dict(n_dense_layers=0, dense_layers=[1, 1])):
        with pytest.raises(ConfigError, match="dense_layers"):
            MoEConfig(n_layers=4, **bad)


DROP = object()  # an _edited_copy value that removes the key


def _edited_copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not DROP}))
    return dst


@pytest.mark.parametrize("name,changes,message", [
    ("mixtral", dict(architectures=["LlamaForCausalLM"]), "architectures"),
    ("mixtral", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
     "rope_scaling type 'linear'"),
    ("mixtral", dict(hidden_act="gelu"), "hidden_act"),
    ("mixtral", dict(sliding_window=4096), "sliding_window"),
    ("mixtral", dict(use_sliding_window=False, sliding_window=8), "sliding_window"),  # Mixtral ignores the flag
    ("qwen3_moe", dict(use_sliding_window=True), "use_sliding_window"),
    ("olmoe", dict(attention_bias=True), "attention_bias"),
    ("deepseek_v3", dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob"),
    # keys that size weights have no default worth assuming: their absence is named
    ("mixtral", dict(intermediate_size=DROP), "lacks intermediate_size"),
    ("mixtral", dict(num_key_value_heads=DROP), "lacks num_key_value_heads"),
    ("deepseek_v3", dict(kv_lora_rank=DROP), "lacks kv_lora_rank"),
    ("deepseek_v2", dict(q_lora_rank=DROP), "lacks q_lora_rank"),  # null (full rank) is present, absent is not
    ("deepseek_v2", dict(n_group=DROP), "lacks n_group"),  # group_limited_greedy; transformers has no default
])
def test_unsupported_config_is_refused_naming_the_field(name, changes, message, tmp_path):
    build_reference(name).save_pretrained(tmp_path / "src")
    with pytest.raises(HFFormatError, match=message):
        hf.from_pretrained(_edited_copy(tmp_path / "src", tmp_path / "bad", **changes))


def test_default_tables_are_transformers_defaults():
    """Each family's table of defaults for absent config.json keys equals its transformers config class's."""
    for config_cls, model_cls, _ in FAMILIES.values():
        cls = getattr(transformers, config_cls)
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        defaults["rope_theta"] = cls().rope_parameters["rope_theta"]
        table = hf.FAMILIES[model_cls].DEFAULTS
        assert {key: defaults[key] for key in table} == table, model_cls


# Each edit is read as transformers reads it: absent keys take the class defaults (Mixtral's rms_norm_eps 1e-5
# and rope_theta 1e6; V3's routed_scaling_factor 2.5 and topk_group 4), a top-level
# original_max_position_embeddings beats rope_scaling's, and Qwen3 ignores sliding_window without its flag.
AS_TRANSFORMERS = [
    ("mixtral", dict(rms_norm_eps=DROP, rope_parameters=DROP, rope_theta=DROP)),
    ("deepseek_v3", dict(routed_scaling_factor=DROP, topk_group=DROP, rms_norm_eps=DROP)),
    ("olmoe", dict(rms_norm_eps=DROP, rope_parameters=DROP, clip_qkv=DROP)),
    ("qwen3_moe", dict(original_max_position_embeddings=32)),  # rope_scaling says 16
    ("qwen3_moe", dict(use_sliding_window=DROP, sliding_window=8)),
]


@pytest.mark.parametrize("name,changes", AS_TRANSFORMERS, ids=[f"{n}-{','.join(c)}" for n, c in AS_TRANSFORMERS])
@torch.no_grad()
def test_config_json_is_read_as_transformers_reads_it(name, changes, tmp_path):
    build_reference(name).save_pretrained(tmp_path / "src")
    path = _edited_copy(tmp_path / "src", tmp_path / "edited", **changes)
    logits = transformers.AutoModelForCausalLM.from_pretrained(path).eval()(tokens()).logits
    assert logits.abs().mean() > 0.5
    torch.testing.assert_close(hf.from_pretrained(path, dtype=torch.float32)(tokens()), logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("extra,message", [("model.layers.2.eh_proj.weight", "multi-token-prediction"),
                                           ("model.layers.0.mlp.gate_proj.weight_scale_inv", "quantisation scales"),
                                           ("model.layers.0.self_attn.q_proj.bias", "does not use")])
def test_tensors_that_would_be_dropped_are_refused(extra, message, tmp_path):
    build_reference("deepseek_v3").save_pretrained(tmp_path)
    save_file({extra: torch.zeros(2)}, tmp_path / "extra.safetensors")
    with pytest.raises(HFFormatError, match=message) as err:
        hf.from_pretrained(tmp_path)
    assert extra in str(err.value)


def test_missing_or_pickled_weights_are_refused(tmp_path):
    build_reference("mixtral").save_pretrained(tmp_path / "ok")
    torch.save({}, tmp_path / "ok" / "pytorch_model.bin")
    (tmp_path / "ok" / "model.safetensors").rename(tmp_path / "weights")
    with pytest.raises(HFFormatError, match="no \\*.safetensors"):
        hf.from_pretrained(tmp_path / "ok")
    state = load_file(tmp_path / "weights")
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, tmp_path / "ok" / "model.safetensors")
    with pytest.raises(HFFormatError, match="lacks 1 tensors"):
        hf.from_pretrained(tmp_path / "ok")


def test_saving_what_the_format_cannot_hold_is_refused(family, tmp_path):
    name, ref, path = family
    ours = hf.from_pretrained(path)
    if name not in BIAS_SLOT:  # these families lack a slot for the balancing bias
        ours.moe_layers()[0].router.expert_bias[0] = 0.5
        bias = f"layers.{next(i for i, b in enumerate(ours.layers) if b.is_moe)}.ffn.router.expert_bias"
        with pytest.raises(HFFormatError, match=f"{bias} is non-zero") as err:
            hf.save_pretrained(ours, tmp_path / "out", architecture=ref.config.architectures[0])
        assert "DeepseekV3" not in str(err.value)  # V3 routes with sigmoid scores: no help to a softmax model
        assert not (tmp_path / "out").exists()  # refused before writing
        try:  # the automatic choice passes over the families that cannot hold the bias
            assert json.loads((hf.save_pretrained(ours, tmp_path / "auto") / "config.json").read_text())[
                "architectures"][0] in BIAS_ARCHITECTURES
        except HFFormatError as error:
            assert str(error).startswith("no Hugging Face family can hold this model") and "non-zero" in str(error)
    other = "MixtralForCausalLM" if name != "mixtral" else "DeepseekV3ForCausalLM"
    with pytest.raises(HFFormatError, match=f"cannot be written as {other}"):
        hf.save_pretrained(ours, tmp_path / "other", architecture=other)
    with pytest.raises(HFFormatError, match="no Hugging Face family can hold"):
        hf.save_pretrained(MoETransformer(MoEConfig(n_layers=1)), tmp_path / "default")  # softmax + shared experts


def test_training_leaves_a_bias_the_format_cannot_hold_at_zero(family, tmp_path):
    """Bias-less families load with bias_update_rate=0, so a fine-tuned model can be saved in its own format."""
    name, ref, path = family
    ours = hf.from_pretrained(path)
    assert ours.config.bias_update_rate == (1e-3 if name in BIAS_SLOT else 0.0)
    for moe in ours.moe_layers():  # what MoELanguageModel does after each optimizer step
        moe.router.update_bias(torch.arange(ours.config.num_experts), ours.config.bias_update_rate)
    hf.save_pretrained(ours, tmp_path / "out", architecture=ref.config.architectures[0])
    module = MoELanguageModel(MoEConfig(bias_update_rate=2e-3), pretrained=str(path))
    assert module.config.bias_update_rate == 2e-3  # a training setting: the user may train the bias anyway


@pytest.mark.parametrize("architecture,change,message", [
    ("OlmoeForCausalLM", dict(head_dim=16), "head_dim=16 cannot be written as OlmoeForCausalLM"),
    ("DeepseekV3ForCausalLM", dict(n_expert_groups=8, n_limited_groups=4), "groups of fewer than 2 experts"),
])
def test_layouts_transformers_cannot_load_are_refused(architecture, change, message, tmp_path):
    name = {"OlmoeForCausalLM": "olmoe", "DeepseekV3ForCausalLM": "deepseek_v3"}[architecture]
    build_reference(name).save_pretrained(tmp_path / "src")
    config = dataclasses.replace(hf.load_config(tmp_path / "src"), **change)
    with torch.device("meta"):
        model = MoETransformer(config)
    with pytest.raises(HFFormatError, match=message):
        hf.save_pretrained(model, tmp_path / "out", architecture=architecture)


def test_failed_save_leaves_the_previous_directory(tmp_path):
    build_reference("mixtral").save_pretrained(tmp_path / "src")
    ours = hf.from_pretrained(tmp_path / "src")
    out = hf.save_pretrained(ours, tmp_path / "out", max_shard_bytes=64 * 2**10)
    (out / "tokenizer.json").write_text("{}")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    state = ours.state_dict()

    def failing(name):
        if name == "layers.1.ffn.experts.w2_EDF":  # written after several shards
            raise OSError("disk full")
        return state[name]
    with pytest.raises(OSError, match="disk full"):
        hf.write_pretrained(ours.config, failing, out, max_shard_bytes=64 * 2**10)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no partial directory left behind
    hf.save_pretrained(ours, out)  # one shard now: the old ones go, the tokenizer stays
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model-00001-of-00001.safetensors",
                                                     "model.safetensors.index.json", "tokenizer.json"]


def test_module_starts_from_pretrained_weights(family):
    name, ref, path = family
    module = MoELanguageModel(MoEConfig(aux_loss_coef=0.01), pretrained=str(path))
    module.configure_model()
    assert module.config.aux_loss_coef == 0.01  # a training setting may differ from the checkpoint
    assert module.hparams["config"] == module.config  # checkpoints record the checkpoint's shape
    expected = hf.from_pretrained(path, dtype=torch.float32).state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in module.model.state_dict().items())
    other = MoELanguageModel(MoEConfig(dim=64, max_seq_len=24), pretrained=str(path))  # a config sized otherwise
    assert other.config == dataclasses.replace(hf.load_config(path), max_seq_len=24)  # its shape is replaced


def test_cli_fit_from_pretrained_uses_its_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path / "mixtral"
    build_reference("mixtral").save_pretrained(path)
    words = {w: i for i, w in enumerate(["[UNK]", "def", "return", "import", "self", "if", "for", "in", "=", "("])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    run = commands.run(["fit", "--model=moe_lightning.MoELanguageModel", f"--model.init_args.pretrained={path}",
                   "--data=moe_lightning.TextDataModule", f"--data.init_args.source={shutil.__file__}",
                   "--data.init_args.seq_len=16", "--data.init_args.batch_size=2", "--trainer.fast_dev_run=true",
                   "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
                   f"--trainer.default_root_dir={tmp_path}"])
    assert run.datamodule.tokenizer.vocab_size == len(words) + 1  # the directory's tokenizer, not bytes
    assert run.model.config == hf.load_config(path) and run.trainer.global_step == 1


def test_convert_both_directions_is_bitwise(family, tmp_path):
    name, ref, path = family
    commands.run(["convert", str(path), "--out", str(tmp_path / "model.pt")])
    payload = torch.load(tmp_path / "model.pt", weights_only=True)
    assert MoEConfig(**payload["config"]) == hf.load_config(path)
    commands.run(["convert", str(tmp_path / "model.pt"), "--out", str(tmp_path / "back")])
    original, back = safetensors_of(path), safetensors_of(tmp_path / "back")
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in original)
    lightning_ckpt = {"state_dict": {f"model.{k}": v for k, v in payload["state_dict"].items()},
                      "hyper_parameters": {"config": MoEConfig(**payload["config"])}}  # as Lightning saves it
    torch.save(lightning_ckpt, tmp_path / "last.ckpt")
    commands.run(["export", str(tmp_path / "last.ckpt"), "--hf", "--out", str(tmp_path / "exported")])
    exported = safetensors_of(tmp_path / "exported")
    assert set(exported) == set(original) and all(torch.equal(exported[k], original[k]) for k in original)


def test_convert_to_pt_refuses_flags_it_would_ignore(tmp_path, capsys):
    build_reference("mixtral").save_pretrained(tmp_path / "src")
    for flag in (["--architecture", "MixtralForCausalLM"], ["--shard-gb", "1"]):
        with pytest.raises(SystemExit):
            commands.run(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "model.pt"), *flag])
        assert f"{flag[0]} only applies when writing a Hugging Face directory" in capsys.readouterr().err
    assert not (tmp_path / "model.pt").exists()


@pytest.fixture(scope="module")
def sharded_load(tmp_path_factory):
    """DeepSeek-V3 with its MTP layer loaded by 2 gloo ranks with expert_parallel_size 2 (one training step at lr 0
    runs the MTP block too), then saved as a sharded checkpoint."""
    tmp = tmp_path_factory.mktemp("sharded")
    mtp_checkpoint(tmp / "hf")
    run_ranks(REPO_ROOT / "tests" / "launchers" / "hf_shard_run.py", 2, "--pretrained", str(tmp / "hf"), "--out",
              str(tmp / "result.json"), "--ckpt", str(tmp / "sharded.ckpt"))
    return tmp, [json.loads((tmp / f"result.json.{rank}").read_text()) for rank in range(2)]


def test_sharded_load_equals_single_process_and_reads_only_local_slices(sharded_load):
    tmp, results = sharded_load
    total = sum(t.numel() * t.element_size() for t in safetensors_of(tmp / "hf").values())
    for rank, result in enumerate(results):
        assert result["mismatched"] == [] and result["compared"] == 32 + 4 + 17  # main, MTP norms + proj, MTP block
        for layer in (1, 2):  # the last main block and the MTP block
            experts = {int(k.split(".")[5]) for k in result["reads"] if f"layers.{layer}.mlp.experts." in k}
            assert experts == set(range(4 * rank, 4 * rank + 4))  # ep rank r owns experts [4r, 4r + 4)
        assert sum(result["reads"].values()) < 0.6 * total  # no rank reads the whole model


def test_export_sharded_checkpoint_to_hf_is_bitwise(sharded_load):
    tmp, _ = sharded_load
    commands.run(["export", str(tmp / "sharded.ckpt"), "--hf", "--out", str(tmp / "exported")])
    original, exported = safetensors_of(tmp / "hf"), safetensors_of(tmp / "exported")
    assert set(exported) == set(original) and all(torch.equal(exported[k], original[k]) for k in original)
    commands.run(["export", str(tmp / "sharded.ckpt"), "--out", str(tmp / "model.pt")])  # without --hf: one .pt file
    state = torch.load(tmp / "model.pt", weights_only=False)["state_dict"]
    assert torch.equal(state["layers.1.ffn.router.expert_bias"],
                       original["model.layers.1.mlp.gate.e_score_correction_bias"])


def test_a_stage_checks_the_release_against_the_whole_model_before_reading_its_part(tmp_path):
    """A stage fills only its own tensors, but a release wrong in another stage's tensor is refused on this stage
    too, before any read (one stage raising while the other waits in a collective would hang the job)."""
    from moe_lightning.parallel.pipeline import keep_stage, resolve_pipeline
    model = mtp_checkpoint(tmp_path / "hf")
    whole = {name: t.shape for name, t in model.state_dict().items()}
    stage0 = keep_stage(MoETransformer(model.config), 0, resolve_pipeline(model.config, 2)).state_dict()
    assert "layers.1.attention.wo.weight" not in stage0
    hf.fill_state_dict(stage0, tmp_path / "hf", whole)
    assert all(torch.equal(t, model.state_dict()[name]) for name, t in stage0.items())
    with pytest.raises(HFFormatError, match="layers.1.attention.wo.weight"):
        hf.fill_state_dict(stage0, tmp_path / "hf", {**whole, "layers.1.attention.wo.weight": torch.Size([32, 31])})


@pytest.mark.extended  # two 2-process runs; the reader's part in one process above
def test_a_release_loads_into_two_pipeline_stages_and_their_checkpoint_exports_it_bitwise(tmp_path):
    """DeepSeek-V3 with its MTP layer at pipeline_parallel_size 2 (built on the meta device, as every release is):
    each stage reads and holds its own tensors, equal to a one-process load, the last stage's copy of the embedding
    (MTP reads it) included; together they hold every tensor; the stages' sharded checkpoint exports back to the
    release bitwise. Before, the strategy's meta-device build crashed in ``init_weights`` on a stage without an
    embedding, and the reader refused a state dict holding part of the model."""
    mtp_checkpoint(tmp_path / "hf")
    run_ranks(REPO_ROOT / "tests" / "launchers" / "hf_shard_run.py", 2, "--pretrained", str(tmp_path / "hf"),
              "--ep", "1", "--pp", "2", "--out", str(tmp_path / "result.json"), "--ckpt",
              str(tmp_path / "staged.ckpt"))
    results = [json.loads((tmp_path / f"result.json.{rank}").read_text()) for rank in range(2)]
    assert all(result["mismatched"] == [] for result in results)
    first, last = (set(result["names"]) for result in results)
    assert "model.tok_embeddings.weight" in first & last and "model.output.weight" in last - first
    assert len(first | last) == 32 + 4 + 17 and not any(".layers.1." in name for name in first)
    assert not any(key.startswith("model.layers.0.") for key in results[1]["reads"])  # stage 1: blocks 1 and MTP
    later_blocks = [key for key in results[0]["reads"] if key.startswith(("model.layers.1.", "model.layers.2."))]
    assert later_blocks == ["model.layers.2.embed_tokens.weight"]  # stage 0 reads block 0 (the MTP layer's embedding
    # is the release's copy of the one the model keeps)
    commands.run(["export", str(tmp_path / "staged.ckpt"), "--hf", "--out", str(tmp_path / "exported")])
    original, exported = safetensors_of(tmp_path / "hf"), safetensors_of(tmp_path / "exported")
    assert set(exported) == set(original) and all(torch.equal(exported[k], original[k]) for k in original)


# ---- DeepSeek-V3 multi-token prediction layers ----------------------------------------------------------------

def mtp_checkpoint(path: Path) -> MoETransformer:
    """A DeepSeek-V3 directory with one MTP layer (``model.layers.2.*``), written from our model with O(1) weights."""
    config = dataclasses.replace(hf.load_config(_v3_dir(path.parent / "plain")), mtp_layers=1)
    torch.manual_seed(3)
    model = MoETransformer(config)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
            elif name.endswith("expert_bias"):
                tensor.copy_(0.1 * torch.randn_like(tensor))
            elif tensor.ndim >= 2:
                tensor.normal_(0, 0.3)
    hf.save_pretrained(model, path, max_shard_bytes=20 * 2**10)
    return model


def _v3_dir(path: Path) -> Path:
    build_reference("deepseek_v3").save_pretrained(path)
    return path


def test_mtp_layer_uses_the_released_names_and_round_trips_bitwise(tmp_path):
    mtp_checkpoint(tmp_path / "mtp")
    written = safetensors_of(tmp_path / "mtp")
    p = "model.layers.2."
    for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
                "embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight", "mlp.experts.7.down_proj.weight",
                "mlp.gate.e_score_correction_bias", "input_layernorm.weight"):
        assert p + key in written, key
    assert written[p + "eh_proj.weight"].shape == (32, 64)
    assert torch.equal(written[p + "embed_tokens.weight"], written["model.embed_tokens.weight"])
    assert torch.equal(written[p + "shared_head.head.weight"], written["lm_head.weight"])
    assert json.loads((tmp_path / "mtp" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    loaded = hf.from_pretrained(tmp_path / "mtp")
    assert loaded.config.mtp_layers == 1 and loaded.mtp[0].block.is_moe
    again = safetensors_of(hf.save_pretrained(loaded, tmp_path / "again"))
    assert set(again) == set(written) and all(torch.equal(again[k], written[k]) for k in written)
    commands.run(["convert", str(tmp_path / "mtp"), "--out", str(tmp_path / "model.pt")])  # and through our .pt file
    commands.run(["convert", str(tmp_path / "model.pt"), "--out", str(tmp_path / "back")])
    back = safetensors_of(tmp_path / "back")
    assert set(back) == set(written) and all(torch.equal(back[k], written[k]) for k in written)


@torch.no_grad()
def test_mtp_layer_computes_what_transformers_mtp_model_computes(tmp_path):
    """transformers' own ``MtpModel`` (the speculative-decoding drafter) loads the layer by its released names and
    gives the same depth-1 logits: the ``[enorm(embedding), hnorm(hidden)]`` order and every name are checked."""
    ours = mtp_checkpoint(tmp_path / "mtp").eval()
    from transformers.modeling_layers import MtpModel

    main = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "mtp").eval()
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2.*"]  # its list names layer 61 (the full model's)
    drafter = MtpModel.from_pretrained(main).eval()
    ids = tokens(12)
    h0 = main.model(ids).last_hidden_state  # the main model's final-normed hidden state, as ours passes it
    torch.testing.assert_close(h0, ours(ids, return_hidden=True), atol=1e-4, rtol=0)
    positions = torch.arange(1, 12)[None].expand(2, -1)  # the token k=1 ahead, at its own position
    h1 = drafter.forward_layer(0, h0[:, :-1], positions, None, input_ids=ids[:, 1:])
    expected = drafter._project_to_logits(h1)
    assert expected.abs().mean() > 0.5
    torch.testing.assert_close(ours.output(ours(ids, mtp=True)[1]), expected, atol=1e-4, rtol=0)


def test_mtp_tensors_without_mtp_layers_are_refused_as_before(tmp_path):
    mtp_checkpoint(tmp_path / "mtp")
    config = json.loads((tmp_path / "mtp" / "config.json").read_text())
    (tmp_path / "mtp" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(HFFormatError, match=r"multi-token-prediction layer tensors such as .*model\.layers\.2\."):
        hf.from_pretrained(tmp_path / "mtp")


@pytest.mark.parametrize("declared", [1, 2])
def test_transformers_v3_declaring_mtp_layers_without_their_tensors_loads_the_main_model_and_warns(tmp_path,
                                                                                                  declared):
    """transformers' DeepseekV3Config writes num_nextn_predict_layers=1 by default, but save_pretrained saves no
    ``model.layers.{n}`` MTP tensors: only tensors that are there count as an MTP layer. A Python user is told
    through ``warnings`` (before: a log line only ``fit``'s logging showed)."""
    ref = build_reference("deepseek_v3", num_mtp_layers=1)
    ref.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": declared}))
    assert not any(k.startswith("model.layers.2.") for k in SafetensorsDir(tmp_path).keys())
    message = rf"num_nextn_predict_layers={declared} but holds no model\.layers\.2\.eh_proj\.weight.*mtp_layers=0"
    with pytest.warns(UserWarning, match=message):
        ours = hf.from_pretrained(tmp_path).eval()
    with pytest.warns(UserWarning, match=message):
        assert ours.config.mtp_layers == 0 and hf.load_config(tmp_path).mtp_layers == 0
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), ref(tokens()).logits, atol=1e-4, rtol=0)


def test_mtp_copies_of_embedding_or_head_that_differ_are_refused(tmp_path):
    mtp_checkpoint(tmp_path / "mtp")
    files = {f: load_file(f) for f in glob.glob(f"{tmp_path / 'mtp'}/*.safetensors")}
    for file, tensors in files.items():
        if "model.layers.2.shared_head.head.weight" in tensors:
            tensors["model.layers.2.shared_head.head.weight"][0, 0] += 1
            save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match=r"'model.layers.2.shared_head.head.weight' differs from 'lm_head.weight'"):
        hf.from_pretrained(tmp_path / "mtp")


def test_mtp_layers_cannot_be_written_where_the_format_has_none(tmp_path):
    build_reference("mixtral").save_pretrained(tmp_path)
    config = dataclasses.replace(hf.load_config(tmp_path), mtp_layers=1)
    with pytest.raises(HFFormatError, match=r"mtp_layers=1 cannot be written as MixtralForCausalLM"):
        hf.FAMILIES["MixtralForCausalLM"].config_to_hf(config)


def small_model_of(config: MoEConfig) -> MoETransformer:
    """``config``'s model at test size: every structural field kept (attention kind, router, groups, dense blocks,
    shared experts, QK-norm...), widths and counts cut; O(1) random weights, and a non-zero balancing bias where the
    config trains one."""
    experts = min(config.num_experts, max(8, 2 * config.n_expert_groups))
    sizes = dict(vocab_size=320, dim=64, max_seq_len=64, ffn_hidden=96, expert_hidden=32, num_experts=experts,
                 top_k=min(config.top_k, experts // 2), n_layers=config.n_layers - config.n_moe_layers + 2,
                 n_heads=4, init_std=0.3, head_dim=None)
    if config.attention == "mla":
        sizes.update(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     q_lora_rank=16 if config.q_lora_rank else 0, n_kv_heads=4)
    else:
        sizes.update(n_kv_heads=2)
    small = MoEConfig(**{**dataclasses.asdict(config), **sizes})
    torch.manual_seed(0)
    model = MoETransformer(small).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
        if config.bias_update_rate:
            for moe in model.moe_layers():
                moe.router.expert_bias.copy_(0.1 * torch.randn_like(moe.router.expert_bias))
    return model


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs").glob("*.yaml")), ids=lambda path: path.name)
@torch.no_grad()
def test_every_shipped_config_exports_to_a_family_transformers_computes_alike(path, tmp_path):
    """Before: ``export --hf`` of configs/tiny.yaml's model failed for all five families (a leading dense block,
    softmax routing with the balancing bias, shared experts, no QK-norm); small.yaml's too. ERNIE 4.5 MoE now holds
    tiny's kind and GLM-4.5 MoE small's; the MLA configs go to DeepSeek-V2/V3."""
    config = MoEConfig(**yaml.safe_load(path.read_text())["model"]["init_args"]["config"])
    ours = small_model_of(config)
    out = hf.save_pretrained(ours, tmp_path / "hf")  # the family chosen from the config alone
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    logits = ours(tokens())
    assert logits.abs().mean() > 0.5
    torch.testing.assert_close(reloaded.eval()(tokens()).logits, logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rate, bias", [(1e-3, 0.0), (0.0, 0.5)], ids=["bias-trained", "bias-non-zero"])
def test_automatic_family_has_a_slot_for_a_balancing_bias_that_is_or_will_be_non_zero(rate, bias):
    """Was: Mixtral (first that fits the shapes), whose save then refused "expert_bias is non-zero"; ERNIE 4.5
    holds softmax routing with a bias."""
    config = MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_dense_layers=0, num_experts=4,
                       top_k=2, expert_hidden=32, n_shared_experts=0, score_func="softmax", bias_update_rate=rate)
    get = lambda name: torch.full((4,), bias) if name.endswith("expert_bias") else None  # noqa: E731
    assert hf.choose_family(config, **({"get": get} if bias else {})).ARCHITECTURE == "Ernie4_5_MoeForCausalLM"
    assert hf.choose_family(dataclasses.replace(config, bias_update_rate=0.0)).ARCHITECTURE == "MixtralForCausalLM"
