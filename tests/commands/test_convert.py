"""``moe-lightning convert`` from a Hugging Face folder to ``.pt``: streamed one tensor at a time, block-FP8 weights
dequantised to float32 (so converting back gives the release's blocks and scales bitwise), and the folder's
``model_type`` and ``auto_map`` (a Kimi K2 is ``kimi_k2``) kept on the way back."""

import json
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
import transformers

from moe_lightning.checkpoint.commit import _verify_zip
from moe_lightning.commands import main as commands
from moe_lightning.commands.loading import pretrained_kept, stream_model_file
from moe_lightning.hf import save_pretrained
from moe_lightning.model import MoEConfig, MoETransformer

from tests.hf.test_fp8 import KIMI, KIMI_JSON, bitwise_equal, build_release, tensors_of
from tests.support.distributed import REPO_ROOT, clean_env

# Peak anonymous memory (RssAnon, sampled every 2 ms: the file-backed pages of the memory-mapped safetensors shards
# are page cache the kernel reclaims, not the process's own) over what it was just before the conversion.
PEAK = """
import json, sys, threading, time
import moe_lightning.commands.convert  # imported before the baseline
from moe_lightning.commands import main as commands
from moe_lightning.commands.loading import pretrained_kept, stream_model_file

def anonymous() -> int:
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:"))

before, peak, done = anonymous(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anonymous())
        time.sleep(0.002)
sampler = threading.Thread(target=sample)
sampler.start()
commands.run(["convert", sys.argv[1], "--out", sys.argv[2]])
done.set()
sampler.join()
print(json.dumps({"growth": max(peak[0], anonymous()) - before}))
"""


@pytest.mark.extended  # writes and converts a 216 MiB folder (~30 s on 2 loaded cores)
def test_convert_to_pt_holds_about_one_tensor_not_the_model(tmp_path):
    """A bf16 Mixtral-shaped folder of 216 MiB whose largest tensor is 8 MiB: converting it to .pt grows the
    process's anonymous memory by less than a quarter of the model (measured +28.8 MiB; the whole-model path it
    replaces, from_pretrained then torch.save: +200.4 MiB), and the file holds every tensor bitwise."""
    config = MoEConfig(vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, max_seq_len=64, ffn_hidden=1024,
                       num_experts=8, top_k=2, expert_hidden=1024, n_shared_experts=0, n_dense_layers=0,
                       bias_update_rate=0.0)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MoETransformer(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 1)
    for b in model.buffers():
        b.zero_()
    save_pretrained(model, tmp_path / "hf", max_shard_bytes=64 * 2**20)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert max(p.numel() * p.element_size() for p in model.parameters()) <= 8 * 2**20 < model_bytes / 25
    result = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "hf"), str(tmp_path / "model.pt")],
                            cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    growth = json.loads(result.stdout.strip().splitlines()[-1])["growth"]
    print(f"convert HF -> .pt: anonymous memory +{growth / 2**20:.1f} MiB for a {model_bytes / 2**20:.1f} MiB folder")
    assert growth < model_bytes / 4, (growth, model_bytes)
    state = torch.load(tmp_path / "model.pt", weights_only=True)["state_dict"]
    for name, tensor in model.state_dict().items():  # the balancing bias is held in float32 (the router's dtype)
        assert bitwise_equal(state[name].to(tensor.dtype) if name.endswith("expert_bias") else state[name], tensor), name


@pytest.mark.slow  # writes and converts a 408 MiB folder
def test_convert_holds_the_largest_tensor_and_little_more(tmp_path):
    """An fp32 Mixtral-shaped folder whose expert stacks are 128 MiB each: converting it grows the process's
    anonymous memory by the largest tensor plus less than 64 MiB (measured +167.0 MiB; was +364.9 MiB: the
    non-finite check's ``isfinite`` of the whole stack built its ``abs()`` copy and masks beside it)."""
    config = MoEConfig(vocab_size=1024, dim=1024, n_layers=1, n_heads=8, n_kv_heads=8, max_seq_len=64,
                       ffn_hidden=1024, num_experts=8, top_k=2, expert_hidden=4096, n_shared_experts=0,
                       n_dense_layers=0, bias_update_rate=0.0)
    with torch.device("meta"):
        model = MoETransformer(config)
    model = model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, 1)
    for b in model.buffers():
        b.zero_()
    save_pretrained(model, tmp_path / "hf", max_shard_bytes=256 * 2**20)
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    assert largest == 128 * 2**20
    del model
    result = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "hf"), str(tmp_path / "model.pt")],
                            cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    growth = json.loads(result.stdout.strip().splitlines()[-1])["growth"]
    print(f"convert HF -> .pt: anonymous memory +{growth / 2**20:.1f} MiB, largest tensor {largest / 2**20:.0f} MiB")
    assert growth < largest + 64 * 2**20, growth

def test_a_streamed_file_is_the_tensors_read_and_loads_as_torch_saves_it(tmp_path):
    """Every dtype the converter writes (fp32, bf16, float8), an empty tensor and a tied pair (one storage, one
    record): torch.load gives back each tensor read, bitwise, and the tied names share their storage."""
    values = {"a": torch.randn(3, 5), "empty": torch.empty(0, 4), "bf16": torch.randn(7).bfloat16(),
              "fp8": torch.randn(4, 4).to(torch.float8_e4m3fn)}
    skeleton = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in values.items()}
    skeleton["tied"] = skeleton["a"]
    reads = []
    path = stream_model_file(tmp_path / "m.pt", {"dim": 5}, skeleton, lambda n: reads.append(n) or values[n], None)
    loaded = torch.load(path, weights_only=True)
    assert loaded["config"] == {"dim": 5} and loaded["tokenizer"] is None
    for name, tensor in values.items():
        assert bitwise_equal(loaded["state_dict"][name], tensor), name
    assert loaded["state_dict"]["tied"].data_ptr() == loaded["state_dict"]["a"].data_ptr()
    assert sorted(reads) == ["a", "bf16", "empty", "fp8"]  # each storage read once: the tied head is not read again


def test_a_streamed_file_passes_its_crc_checks(tmp_path):
    """The records filled after the save carry the CRC-32 of the bytes written, in the central directory and in the
    data descriptor after the bytes (torch's writer defers the local header's CRC there) (was: the CRC of the
    skipped bytes, so zipfile's testzip and the package's own checkpoint check called the file damaged)."""
    values = {"a": torch.randn(300, 5), "bf16": torch.randn(7).bfloat16(), "empty": torch.empty(0, 4)}
    skeleton = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in values.items()}
    path = stream_model_file(tmp_path / "m.pt", {"dim": 5}, skeleton, values.__getitem__, None)
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # reads each record, checking it against the central directory's CRC
        for info in archive.infolist():
            header = info.header_offset
            if not info.flag_bits & 0x08:  # an empty record: the CRC (0) is in its local header
                assert int.from_bytes(raw[header + 14:header + 18], "little") == info.CRC, info.filename
                continue
            lengths = int.from_bytes(raw[header + 26:header + 28], "little") + \
                int.from_bytes(raw[header + 28:header + 30], "little")
            descriptor = header + 30 + lengths + info.file_size
            assert raw[descriptor:descriptor + 4] == b"PK\x07\x08", info.filename
            assert int.from_bytes(raw[descriptor + 4:descriptor + 8], "little") == info.CRC, info.filename
    _verify_zip(path)


# A release's remote code, as text that would fail if anything ran it (it is only ever copied).
KIMI_CODE = {name: f'raise RuntimeError("{name} must be copied, never run")\n'
             for name in ("configuration_deepseek.py", "modeling_deepseek.py")}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    _, _, path = build_release(tmp_path_factory.mktemp("kimi") / "fp8", KIMI, KIMI_JSON, seed=1)
    for name, text in KIMI_CODE.items():
        (path / name).write_text(text)
    return path


def test_fp8_to_pt_is_float32_and_back_is_the_release_bitwise_keeping_kimis_model_type(kimi, tmp_path):
    """convert (no --dtype) gives float32 attention and FFN weights (the exact dequantisation: its block maxima over
    448 are the scales again), the embedding as stored (bf16); back with --fp8-blocks, every FP8 value and scale is
    the release's bitwise (was: dequantised to bf16, every scale moved by up to 2^-8), and config.json keeps
    model_type kimi_k2 and auto_map (was: rewritten to deepseek_v3, auto_map dropped)."""
    commands.run(["convert", str(kimi), "--out", str(tmp_path / "model.pt")])
    state = torch.load(tmp_path / "model.pt", weights_only=True)["state_dict"]
    assert state["layers.0.attention.wkv_b.weight"].dtype == torch.float32
    assert state["layers.1.ffn.experts.w1_EFD"].dtype == torch.float32
    assert state["tok_embeddings.weight"].dtype == torch.bfloat16
    commands.run(["convert", str(tmp_path / "model.pt"), "--out", str(tmp_path / "back"), "--fp8-blocks"])
    original, back = tensors_of(kimi), tensors_of(tmp_path / "back")
    assert set(back) == set(original)
    assert all(bitwise_equal(back[key], tensor) for key, tensor in original.items())
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config["auto_map"] == KIMI_JSON["auto_map"]
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert {name: (tmp_path / "back" / name).read_text() for name in KIMI_CODE} == KIMI_CODE  # the code auto_map names


def test_without_the_code_auto_map_names_an_export_is_deepseek_v3_and_loads(kimi, tmp_path):
    """A Kimi K2 folder whose remote code is gone: the export says model_type deepseek_v3 without auto_map (one
    warning naming what was dropped), and transformers' AutoConfig reads it without trust_remote_code (was: kimi_k2
    and auto_map kept, so AutoConfig asked for remote code that is not there, and failed)."""
    folder = tmp_path / "no_code"
    shutil.copytree(kimi, folder, ignore=shutil.ignore_patterns("*.py"))
    commands.run(["convert", str(folder), "--out", str(tmp_path / "model.pt")])
    with pytest.warns(UserWarning, match=r"model_type 'deepseek_v3', dropping .*kimi_k2.*configuration_deepseek.py"):
        commands.run(["convert", str(tmp_path / "model.pt"), "--out", str(tmp_path / "back")])
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and "auto_map" not in config
    assert not list((tmp_path / "back").glob("*.py"))
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert isinstance(loaded, transformers.DeepseekV3Config) and loaded.n_routed_experts == KIMI["n_routed_experts"]


def test_kept_keys_are_not_forced_onto_another_architecture(kimi, tmp_path):
    """A Kimi K2 model written as another family (here refused or chosen by shape) never carries kimi_k2."""
    commands.run(["convert", str(kimi), "--out", str(tmp_path / "model.pt"), "--dtype", "fp32"])
    payload = torch.load(tmp_path / "model.pt", weights_only=True)
    assert payload["hf_kept"] == {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
                                  "auto_map": KIMI_JSON["auto_map"], "code": KIMI_CODE}
    payload["hf_kept"]["architectures"] = ["SomethingElse"]
    torch.save(payload, tmp_path / "other.pt")
    commands.run(["convert", str(tmp_path / "other.pt"), "--out", str(tmp_path / "back")])
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and "auto_map" not in config


def test_a_run_started_from_the_folder_exports_with_its_model_type(kimi, tmp_path):
    """A Lightning or sharded checkpoint of `fit --model.init_args.pretrained=<folder>` records the folder's path:
    its model_type and auto_map are read there while it exists (nothing is guessed once it is gone)."""
    kept = pretrained_kept({"hyper_parameters": {"pretrained": str(kimi)}})
    assert kept == {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
                    "auto_map": KIMI_JSON["auto_map"], "code": KIMI_CODE}
    assert pretrained_kept({"hyper_parameters": {"pretrained": str(tmp_path / "gone")}}) is None
    assert pretrained_kept({"hyper_parameters": {}}) is None
