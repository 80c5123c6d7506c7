"""Block-FP8 releases (DeepSeek-V3, Kimi K2) in and out, checked against the test's own quantiser.

The folders are built here as the releases are: a tiny ``transformers`` DeepseekV3 model with weights scaled to give
O(1) activations, every Linear weight of attention and the FFNs quantised by this file's own few lines (amax / 448
per 128 x 128 block, float32 scales), the rest in bf16 (the balancing bias float32), sharded with an index. Dims of
160, 200 and 264 leave partial edge blocks. Loading is compared, bitwise, with this file's own dequantisation
(weight x scale in float32) and, through the logits, with transformers' model holding those dequantised weights.
"""

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from moe_lightning import MoELanguageModel, hf  # noqa: E402
from moe_lightning.commands.loading import load_model  # noqa: E402
from moe_lightning.commands import main as commands  # noqa: E402
from moe_lightning.hf import HFFormatError, fp8  # noqa: E402
from moe_lightning.hf.files import SafetensorsDir  # noqa: E402
from moe_lightning.model import MoETransformer  # noqa: E402

from tests.support.distributed import REPO_ROOT, run_ranks  # noqa: E402

B = 128
F8 = torch.float8_e4m3fn
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# DeepSeek-V3's layout at a tiny size: every projection has an edge block of 8 to 136 rows or columns
V3 = dict(vocab_size=320, hidden_size=200, num_attention_heads=4, q_lora_rank=136, kv_lora_rank=160,
          qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=264, moe_intermediate_size=160,
          n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
          num_hidden_layers=2, first_k_dense_replace=1, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
          max_position_embeddings=163840, num_nextn_predict_layers=0,
          rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
# Kimi K2's config.json values (its own YaRN and routing: one group, scale 2.827, theta 50,000), sizes shrunk
KIMI = {**V3, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"}}
KIMI_JSON = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "aux_loss_alpha": 0.001,
             "seq_aux": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
             "moe_layer_freq": 1, "pretraining_tp": 1, "bos_token_id": 163584, "eos_token_id": 163585,
             "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                          "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}


# ---- the test's own block FP8 (independent of moe_lightning.hf.fp8) ----------------------------------------------

def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """amax / 448 per 128 x 128 block (float32), an all-zero block scaled by 1; weight / scale rounded to e4m3."""
    w = w.float()
    scale = torch.ones(math.ceil(w.shape[0] / B), math.ceil(w.shape[1] / B))
    q = torch.empty(w.shape, dtype=F8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * B:(i + 1) * B, j * B:(j + 1) * B]
            if block.abs().max() > 0:
                scale[i, j] = block.abs().max() / 448.0
            q[i * B:(i + 1) * B, j * B:(j + 1) * B] = (block / scale[i, j]).to(F8)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * B:(i + 1) * B, j * B:(j + 1) * B] = q[i * B:(i + 1) * B, j * B:(j + 1) * B].float() * scale[i, j]
    return out


def is_quantized(key: str) -> bool:
    """The release's choice: projections of attention, dense MLPs, shared and routed experts."""
    return ".self_attn." in key and "layernorm" not in key or ".mlp." in key and key.endswith("proj.weight")


def write_release(path: Path, state: dict[str, torch.Tensor], config: dict, n_files: int = 3) -> Path:
    """safetensors shards + ``model.safetensors.index.json`` + config.json, as a release is laid out."""
    path.mkdir(parents=True)
    keys = sorted(state)
    weight_map = {}
    for f in range(n_files):
        name = f"model-{f + 1:05d}-of-{n_files:05d}.safetensors"
        part = {k: state[k].contiguous() for k in keys[f::n_files]}
        save_file(part, path / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return path


def build_release(path: Path, values: dict, extra_json: dict | None = None, seed: int = 0):
    """(transformers model holding the dequantised weights, {key: dequantised float32}, FP8 folder ``path``); the
    same model unquantised in float32 is ``path.parent / "plain"``."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**values))
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if key.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn_like(t))
            elif key.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn_like(t))
            elif key.endswith("embed_tokens.weight"):
                t.normal_(0, 1)
            elif t.ndim >= 2:
                t.normal_(0, 1.5 / t.shape[-1] ** 0.5)  # O(1) outputs from O(1) inputs
    model.save_pretrained(path.parent / "source")  # the checkpoint layout: one tensor per expert
    state, dequantised = {}, {}
    for key, t in tensors_of(path.parent / "source").items():
        if is_quantized(key):
            state[key], state[key + "_scale_inv"] = quantize_blocks(t)
            dequantised[key] = dequantize_blocks(state[key], state[key + "_scale_inv"])
        else:
            state[key] = t if key.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
            dequantised[key] = state[key].float()
    config = json.loads((path.parent / "source" / "config.json").read_text())
    plain = write_release(path.parent / "plain", dequantised, config, n_files=1)
    write_release(path, state, {**config, **values, **(extra_json or {}), "quantization_config": QUANT,
                                "torch_dtype": "bfloat16"})
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(plain).eval()
    return ref, dequantised, path


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("v3") / "fp8", V3)


def tokens(n: int = 12) -> torch.Tensor:
    return torch.randint(0, V3["vocab_size"], (2, n), generator=torch.Generator().manual_seed(1))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_the_folder_is_the_release_format(release):
    """What the loader is tested on: FP8 projections with float32 [ceil(out/128), ceil(in/128)] scales, partial
    blocks on every edge kind, bf16 embeddings, head, norms and router, a float32 bias, several shards."""
    _, _, path = release
    state = tensors_of(path)
    scales = {k: t for k, t in state.items() if k.endswith("_scale_inv")}
    assert len(scales) == 5 + 3 + 5 + 3 * 8 + 3 and all(t.dtype == torch.float32 for t in scales.values())
    for key, scale in scales.items():
        weight = state[key[:-len("_scale_inv")]]
        assert weight.dtype == F8 and scale.shape == (math.ceil(weight.shape[0] / B), math.ceil(weight.shape[1] / B))
    shapes = {tuple(state[k[:-len("_scale_inv")]].shape) for k in scales}
    assert {(160, 200), (200, 160), (264, 200), (200, 264), (192, 136)} <= shapes  # rows and columns cut mid-block
    assert state["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert state["lm_head.weight"].dtype == torch.bfloat16
    assert len(list(path.glob("*.safetensors"))) == 3


@torch.no_grad()
def test_fp8_folder_loads_as_the_tests_own_dequantisation(release, tmp_path):
    ref, dequantised, path = release
    ours = hf.from_pretrained(path, dtype=torch.float32)
    expected = hf.from_pretrained(path.parent / "plain", dtype=torch.float32)  # the same model, unquantised
    for name, tensor in expected.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    logits = ref(tokens()).logits
    assert logits.abs().mean() > 0.5  # O(1) logits: a mapping or scale mistake moves them by O(1)
    torch.testing.assert_close(ours(tokens()), logits, atol=1e-4, rtol=0)
    # no dtype: the dequantised weights take the dtype the release stores the rest in (bf16), as its own tools do
    stored = hf.from_pretrained(path)
    assert stored.layers[1].ffn.experts.w2_EDF.dtype == torch.bfloat16
    assert torch.equal(stored.layers[1].ffn.experts.w2_EDF[3],
                       dequantised["model.layers.1.mlp.experts.3.down_proj.weight"].to(torch.bfloat16))
    assert stored.layers[1].ffn.router.expert_bias.dtype == torch.float32


def test_a_region_reads_only_the_blocks_it_touches(release, monkeypatch):
    """A rank's slice: FP8 values of that slice only, scales of the blocks it touches only; equal to the slice of
    the whole dequantised weight, for regions that start and end inside blocks."""
    _, dequantised, path = release
    reads = []
    original = SafetensorsDir.get

    class Counting:
        def __init__(self, key, inner):
            self.key, self.inner = key, inner

        def __getitem__(self, index):
            out = self.inner[index]
            reads.append((self.key, tuple(out.shape)))
            return out

        def get_shape(self):
            return self.inner.get_shape()

    monkeypatch.setattr(SafetensorsDir, "get", lambda self, key: Counting(key, original(self, key)))
    files = fp8.Dequantized(SafetensorsDir(path), torch.float32)
    key = "model.layers.0.mlp.up_proj.weight"  # [264, 200]: row blocks 128 + 128 + 8, column blocks 128 + 72
    whole = dequantised[key]
    for rows, cols in [((0, 264), (0, 200)), ((130, 200), (5, 127)), ((100, 260), (120, 199)), ((256, 264), (128, 200))]:
        reads.clear()
        region = files.get(key)[slice(*rows), slice(*cols)]
        assert torch.equal(region, whole[slice(*rows), slice(*cols)])
        blocks = (math.ceil(rows[1] / B) - rows[0] // B, math.ceil(cols[1] / B) - cols[0] // B)
        assert reads == [(key, (rows[1] - rows[0], cols[1] - cols[0])), (key + "_scale_inv", blocks)]


def test_module_and_cli_commands_start_from_the_fp8_folder(release, tmp_path, capsys):
    """fit's module (one process), `fit`, `test` and `generate` from the CLI, `convert` to .pt."""
    tokenizers = pytest.importorskip("tokenizers")
    _, dequantised, src = release
    path = tmp_path / "fp8"
    shutil.copytree(src, path)
    words = {w: i for i, w in enumerate(["[UNK]", "def", "return", "import", "self", "if", "for", "in", "=", "("])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    expected = hf.from_pretrained(path, dtype=torch.float32).state_dict()

    module = MoELanguageModel(pretrained=str(path))
    module.configure_model()
    assert all(torch.equal(t, expected[k]) for k, t in module.model.state_dict().items())

    common = ["--model=moe_lightning.MoELanguageModel", f"--model.init_args.pretrained={path}",
              "--data=moe_lightning.TextDataModule", f"--data.init_args.source={shutil.__file__}",
              "--data.init_args.seq_len=16", "--data.init_args.batch_size=2", "--trainer.accelerator=cpu",
              "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path / 'runs'}"]
    run = commands.run(["fit", *common, "--trainer.fast_dev_run=true"])
    assert run.trainer.global_step == 1 and run.model.config == hf.load_config(path)
    run = commands.run(["test", *common, "--trainer.limit_test_batches=1"])
    assert math.isfinite(run.trainer.callback_metrics["test/loss"].item())

    loaded = load_model(path, dtype=torch.float32)
    assert all(torch.equal(t, expected[k]) for k, t in loaded.model.state_dict().items())
    capsys.readouterr()
    commands.run(["generate", str(path), "--prompt", "def self", "--max-new-tokens", "3", "--temperature", "0"])
    assert capsys.readouterr().out.startswith("def self")

    commands.run(["convert", str(path), "--out", str(tmp_path / "model.pt"), "--dtype", "fp32"])
    state = torch.load(tmp_path / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(state[k], t) for k, t in expected.items())


def test_fp8_to_ours_to_fp8_is_bitwise(release, tmp_path):
    """FP8 -> .pt (float32) -> FP8: every tensor, FP8 values and scales included, bitwise, and the config's
    quantization_config as released. Through bf16 the FP8 values still come back bitwise; the scales then move
    (bf16 keeps 8 bits of the block maximum), by less than 2^-8."""
    _, _, path = release
    original = tensors_of(path)
    commands.run(["convert", str(path), "--out", str(tmp_path / "model.pt"), "--dtype", "fp32"])
    commands.run(["convert", str(tmp_path / "model.pt"), "--out", str(tmp_path / "back"), "--fp8-blocks",
                  "--dtype", "bf16", "--shard-gb", str(2**20 / 2**30)])
    back = tensors_of(tmp_path / "back")
    assert set(back) == set(original)
    assert all(bitwise_equal(back[key], tensor) for key, tensor in original.items())
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["quantization_config"] == QUANT and config["torch_dtype"] == "bfloat16"
    assert len(list((tmp_path / "back").glob("*.safetensors"))) > 1

    commands.run(["convert", str(path), "--out", str(tmp_path / "bf16.pt")])  # weights dequantised into bf16
    commands.run(["convert", str(tmp_path / "bf16.pt"), "--out", str(tmp_path / "via_bf16"), "--fp8-blocks"])
    via = tensors_of(tmp_path / "via_bf16")
    for key, tensor in original.items():
        if tensor.dtype == F8:
            assert bitwise_equal(via[key], tensor), key
        elif key.endswith("_scale_inv"):
            torch.testing.assert_close(via[key], tensor, rtol=2**-8, atol=0)


def test_quantisation_rule_is_deepseeks(tmp_path):
    """The package's quantiser equals the test's (amax / 448, float32) bitwise, on partial blocks too; an all-zero
    block gets scale 1 and zeros; a non-finite weight is refused naming it."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(264, 200, generator=generator) * torch.logspace(-3, 1, 200)  # blocks of very different amax
    w[128:256, :128] = 0
    q, scale = fp8.quantize(w, "k")
    q_ref, scale_ref = quantize_blocks(w)
    assert bitwise_equal(scale, scale_ref) and bitwise_equal(q, q_ref)
    assert scale[1, 0] == 1 and not q[128:256, :128].float().any()
    # the round trip's key fact: dequantise (one float32 rounding) and re-derive amax / 448 gives the scale back, for
    # every float32 mantissa (one binade shown; the exponent only shifts it)
    a = torch.from_numpy(((np.int64(127) << 23) | np.arange(2**23)).astype(np.int32)).view(torch.float32)
    s = a / 448.0
    assert torch.equal((s * 448.0) / 448.0, s)
    w[3, 5] = float("inf")
    with pytest.raises(HFFormatError, match="k holds non-finite values"):
        fp8.quantize(w, "k")


def test_mtp_layers_and_the_tensors_kept_in_bf16_are_written_as_released(release, tmp_path):
    """The MTP layer's block is FP8 like any block; its eh_proj, norms, the router, embeddings and head stay
    unquantised; save_pretrained(fp8_blocks=True) reloads to the same float32 weights it was quantised from."""
    _, _, path = release
    config = dataclasses.replace(hf.load_config(path), mtp_layers=1)
    model = MoETransformer(config)
    with torch.no_grad():  # weights FP8 can hold exactly, so the reload must be bitwise
        for name, t in model.state_dict().items():
            for matrix in (t if t.ndim == 3 else [t]) if fp8.quantized(name) else []:
                matrix.copy_(dequantize_blocks(*quantize_blocks(matrix)))
    hf.save_pretrained(model, tmp_path / "out", fp8_blocks=True)
    keys = set(tensors_of(tmp_path / "out"))
    assert "model.layers.2.self_attn.q_a_proj.weight_scale_inv" in keys
    assert "model.layers.2.mlp.experts.7.down_proj.weight_scale_inv" in keys
    for kept in ("model.layers.2.eh_proj.weight", "model.layers.1.mlp.gate.weight", "model.embed_tokens.weight",
                 "lm_head.weight", "model.layers.2.shared_head.head.weight"):
        assert kept in keys and kept + "_scale_inv" not in keys
    reloaded = hf.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert all(torch.equal(reloaded[k], t) for k, t in model.state_dict().items())


def test_kimi_k2_config_maps_and_computes_what_transformers_computes(tmp_path):
    """Kimi K2's config.json (model_type kimi_k2, DeepseekV3ForCausalLM, one expert group, YaRN with beta_fast =
    beta_slow = 1, theta 50,000, routed scale 2.827), as an FP8 release: transformers' DeepseekV3 on the same
    values and dequantised weights computes the same logits."""
    ref, _, path = build_release(tmp_path / "fp8", KIMI, KIMI_JSON, seed=1)
    config = hf.load_config(path)
    assert (config.n_expert_groups, config.route_scale, config.rope_theta, config.rope_factor) == (1, 2.827, 5e4, 32)
    assert (config.rope_beta_fast, config.rope_beta_slow, config.rope_mscale_all_dim) == (1.0, 1.0, 1.0)
    ours = hf.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = ref(tokens()).logits
        assert logits.abs().mean() > 0.5
        torch.testing.assert_close(ours(tokens()), logits, atol=1e-4, rtol=0)


def _edited(src: Path, dst: Path, quant=None, drop=(), replace=None) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if quant is not None:
        config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))
    if drop or replace:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        for key in drop:
            del index["weight_map"][key]
        if replace:
            save_file(replace, dst / "replaced.safetensors")
            index["weight_map"].update({k: "replaced.safetensors" for k in replace})
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


SCALE = "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"
REFUSED = [
    (dict(quant={**QUANT, "quant_method": "awq"}), "quantization_config.quant_method='awq'"),
    (dict(quant={**QUANT, "weight_block_size": [64, 64]}), r"quantization_config.weight_block_size=\[64, 64\]"),
    (dict(quant={"quant_method": "fp8"}), "quantization_config.weight_block_size=None"),
    (dict(quant={**QUANT, "fmt": "e5m2"}), "quantization_config.fmt='e5m2'"),
    (dict(quant={**QUANT, "activation_scheme": "static"}), "quantization_config.activation_scheme='static'"),
    (dict(drop=[SCALE]), "has no 'model.layers.1.mlp.experts.0.up_proj.weight_scale_inv'"),
    (dict(replace={SCALE: torch.ones(1, 1)}), r"has shape \(1, 1\), but a \(160, 200\) weight"),
    (dict(replace={SCALE[:-len("_scale_inv")]: torch.zeros(160, 200, dtype=torch.bfloat16)}), "not float8_e4m3fn"),
]


@pytest.mark.parametrize("edit,message", REFUSED, ids=[m.split("=")[0].split(" ")[-1][:40] for _, m in REFUSED])
def test_what_cannot_be_read_is_refused_in_one_line_naming_it(release, edit, message, tmp_path):
    _, _, path = release
    bad = _edited(path, tmp_path / "bad", **edit)
    with pytest.raises(HFFormatError, match=message) as err:
        hf.from_pretrained(bad)
    assert "\n" not in str(err.value)


def test_fp8_tensors_without_quantization_config_are_refused(release, tmp_path):
    _, _, path = release
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    shutil.copytree(path, tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFFormatError, match="quantisation scales such as .* no quantization_config"):
        hf.from_pretrained(tmp_path / "bad")


def test_convert_to_pt_refuses_fp8_blocks(release, tmp_path, capsys):
    _, _, path = release
    with pytest.raises(SystemExit):
        commands.run(["convert", str(path), "--out", str(tmp_path / "model.pt"), "--fp8-blocks"])
    assert "--fp8-blocks only applies when writing a Hugging Face directory" in capsys.readouterr().err


@pytest.fixture(scope="module")
def sharded_fp8(release, tmp_path_factory):
    """The FP8 folder loaded by 2 gloo ranks under MoEFSDPStrategy (expert_parallel_size 2), as `fit` loads it."""
    _, _, path = release
    tmp = tmp_path_factory.mktemp("sharded_fp8")
    run_ranks(REPO_ROOT / "tests" / "launchers" / "hf_shard_run.py", 2, "--pretrained", str(path), "--out",
              str(tmp / "result.json"), "--ckpt", str(tmp / "sharded.ckpt"))
    return tmp, [json.loads((tmp / f"result.json.{rank}").read_text()) for rank in range(2)]


@pytest.mark.slow  # a 2-process sharded load
def test_sharded_load_reads_only_each_ranks_blocks(release, sharded_fp8):
    _, _, path = release
    tmp, results = sharded_fp8
    total = sum(t.numel() * t.element_size() for t in tensors_of(path).values())
    for rank, result in enumerate(results):
        assert result["mismatched"] == []  # equal to the one-process dequantisation, gathered
        experts = {int(k.split(".")[5]) for k in result["reads"] if ".mlp.experts." in k}
        assert experts == set(range(4 * rank, 4 * rank + 4))  # ep rank r reads its experts' weights and scales only
        assert any(k.endswith("_scale_inv") for k in result["reads"])
        assert sum(result["reads"].values()) < 0.7 * total  # no rank reads the whole model


@pytest.mark.slow  # shares the 2-process sharded load above
def test_sharded_checkpoint_exports_to_the_release_bitwise(release, sharded_fp8):
    """`fit`'s sharded checkpoint of the loaded model -> `export --hf --fp8-blocks --dtype bf16` gives back the
    release, FP8 values and scales bitwise."""
    _, _, path = release
    tmp, _ = sharded_fp8
    commands.run(["export", str(tmp / "sharded.ckpt"), "--hf", "--fp8-blocks", "--dtype", "bf16", "--out",
                  str(tmp / "exported")])
    original, exported = tensors_of(path), tensors_of(tmp / "exported")
    assert set(exported) == set(original)
    assert all(bitwise_equal(exported[key], tensor) for key, tensor in original.items())


def test_a_zero_scale_over_an_all_zero_block_is_read_as_zeros(release, tmp_path):
    """0 x 0 loses nothing: a zero scale over a block whose FP8 values are all zero loads as the same block with
    scale 1 (the quantiser's own choice for an all-zero block) does (was: refused as a damaged scale)."""
    _, _, path = release
    stored = tensors_of(path)
    weight = stored[SCALE.removesuffix("_scale_inv")].float()
    weight[128:256, :128] = 0
    weight = weight.to(torch.float8_e4m3fn)
    folders = {}
    for value in (0.0, 1.0):
        scale = stored[SCALE].clone()
        scale[1, 0] = value
        folders[value] = _edited(path, tmp_path / str(value), replace={SCALE: scale, SCALE.removesuffix("_scale_inv"): weight})
    zero, one = (hf.from_pretrained(folders[v], dtype=torch.float32).state_dict() for v in (0.0, 1.0))
    assert all(bitwise_equal(zero[name], tensor) for name, tensor in one.items())


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0, -1.0], ids=["inf", "nan", "zero", "negative"])
def test_a_scale_that_is_not_finite_and_positive_is_refused_naming_it(release, value, tmp_path, capfd):
    """inf or NaN would make a block of 16,384 non-finite weights, 0 a block of zeros, -1 a sign-flipped block: each
    is refused in one line naming the scale tensor, by the Python API and by `convert` (exit 2, nothing written)."""
    _, _, path = release
    scale = tensors_of(path)[SCALE].clone()
    scale[1, 0] = value
    bad = _edited(path, tmp_path / "bad", replace={SCALE: scale})
    with pytest.raises(HFFormatError, match=rf"{SCALE}' holds 1 scale\(s\) that are not finite and positive") as err:
        hf.from_pretrained(bad)
    assert "\n" not in str(err.value) and "block [1, 0]" in str(err.value)
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        commands.main(["convert", str(bad), "--out", str(tmp_path / "model.pt")])
    err_lines = capfd.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err_lines) == 1 and SCALE in err_lines[0]
    assert not (tmp_path / "model.pt").exists()
