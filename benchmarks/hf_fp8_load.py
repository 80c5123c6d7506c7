"""Peak host memory of loading a block-FP8 (DeepSeek-V3 format) Hugging Face folder, whole and per rank.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/hf_fp8_load.py [--experts 64]

A DeepSeek-V3-shaped model (MLA, dim 1024, ``--experts`` routed experts of hidden 512, 4 blocks, 1 dense) is written
as an FP8 release (128 x 128 blocks, ``*_scale_inv``, 1 GiB-capped shards with an index; about 300 MB at 64 experts)
by ``hf.write_pretrained(fp8_blocks=True)``, then loaded in fresh processes:
- ``from_pretrained(dtype=bf16)``: the whole model on one host (``generate``, ``convert``);
- ``fill_state_dict`` into an allocated float32 model (``fit`` on one process);
- ``fill_state_dict`` on each of 2 gloo ranks whose model is ``fully_shard``-ed (``fit`` under FSDP: each rank
  reads only its rows).
Printed per case: the growth of the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``
after imports and allocation) during the load, beside the loaded tensors' bytes, the safetensors bytes the process
reads (mapped file pages count in RSS while the files are open) and the largest tensor's float32 bytes (one
region is dequantised in float32 before its copy). Bytes, not time: the figure does not depend on the machine's load.
Linux only.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from moe_lightning import hf  # noqa: E402
from moe_lightning.model import MoEConfig, MoETransformer  # noqa: E402


def config_of(experts: int) -> MoEConfig:
    return MoEConfig(vocab_size=8192, dim=1024, n_layers=4, n_heads=8, attention="mla", q_lora_rank=384,
                     kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, ffn_hidden=2816,
                     n_dense_layers=1, num_experts=experts, top_k=4, expert_hidden=512, n_shared_experts=1,
                     score_func="sigmoid", group_score="top2_sum", n_expert_groups=4, n_limited_groups=2,
                     route_norm=True, mla_norm_eps=1e-6, max_seq_len=4096)


def write_release(path: Path, config: MoEConfig) -> None:
    """Random O(1)-scaled weights made one tensor at a time (the folder never exists whole in memory)."""
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in MoETransformer(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)

    def get(name: str) -> torch.Tensor:
        shape = shapes[name]
        if len(shape) == 1:
            return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        tensor = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        return tensor if hf.fp8.quantized(name) or "expert_bias" in name else tensor.to(torch.bfloat16)
    hf.write_pretrained(config, get, path, "DeepseekV3ForCausalLM", max_shard_bytes=2**30 // 8, fp8_blocks=True)


CHILD = """
import json, os, re, sys
from pathlib import Path
import torch
from moe_lightning import hf
from moe_lightning.model import MoETransformer

def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

what, path = sys.argv[1], Path(sys.argv[2])
torch.set_num_threads(1)
config = hf.load_config(path)
if what == "fill":
    model = MoETransformer(config)
elif what == "fsdp":
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo")
    with torch.device("meta"):
        model = MoETransformer(config)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
Path("/proc/self/clear_refs").write_text("5")
before = peak()
if what == "whole":
    model = hf.from_pretrained(path, dtype=torch.bfloat16)
    loaded = model.state_dict()
else:
    loaded = model.state_dict()
    hf.fill_state_dict(loaded, path)
    loaded = {k: t.to_local() if hasattr(t, "to_local") else t for k, t in loaded.items()}
grown = peak() - before
print(json.dumps({"grown": grown, "loaded": sum(t.numel() * t.element_size() for t in loaded.values())}))
"""


def run(what: str, path: Path, ranks: int = 1) -> list[dict]:
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(ranks)}
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, what, str(path)], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"{what} failed:\n{err[-3000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args()
    config = config_of(args.experts)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fp8"
        write_release(path, config)
        files = sorted(path.glob("*.safetensors"))
        on_disk = sum(f.stat().st_size for f in files)
        with torch.device("meta"):
            largest = max(t.numel() for t in MoETransformer(config).state_dict().values()) * 4
        print(f"FP8 folder: {on_disk / 2**20:,.0f} MiB in {len(files)} shards; largest tensor in float32 "
              f"{largest / 2**20:,.0f} MiB", flush=True)
        for what, ranks, label in (("whole", 1, "from_pretrained(dtype=bf16)"),
                                   ("fill", 1, "fill_state_dict, 1 process, fp32"),
                                   ("fsdp", 2, "fill_state_dict, FSDP rank of 2, fp32")):
            for rank, result in enumerate(run(what, path, ranks)):
                print(f"{label:40s} rank {rank}: peak RSS +{result['grown'] / 2**20:,.0f} MiB "
                      f"(loaded tensors {result['loaded'] / 2**20:,.0f} MiB)", flush=True)


if __name__ == "__main__":
    main()
