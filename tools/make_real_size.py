#!/usr/bin/env python3
"""Write a Z-Image-Turbo checkpoint at its real size, in the diffusers layout, with random bf16 weights.

Usage (inside the venv of tools/requirements-fixtures.txt; about 20.6 GB of disk; not committed):

    .venv/bin/python tools/make_real_size.py --out /path/to/z-image-turbo-random

(`cargo xtask fixtures --real-size DIR` runs it.) What it writes, as the real repository lays it out:

* the real configs (`shared/reference/zimage-burn.md`, A.1), saved by the real classes (`save_config`,
  `Qwen3Config.save_pretrained`, `FlowMatchEulerDiscreteScheduler.save_pretrained`), and `model_index.json`;
* the real key list of each model, taken from the real classes built on the meta device (no weights in memory),
  in the classes' order, with the real shapes;
* sharded as diffusers and transformers shard: shards of at most 5 GB (decimal) named
  `diffusion_pytorch_model-0000i-of-0000n.safetensors` (transformer, VAE) and `model-0000i-of-0000n.safetensors`
  (text encoder) with their `*.safetensors.index.json` (`metadata.total_size`, `weight_map`); a model that fits
  one shard is one unsuffixed file, as `save_pretrained` writes it;
* random bf16 weights drawn shard by shard (norm weights 1, biases 0, matrices of unit-variance outputs), so a
  forward gives finite values; the weights are noise, so is the image;
* the tiny checkpoint's tokenizer (a real Qwen tokenizer cannot be downloaded here), whose ids fit the real
  vocabulary.
"""

from __future__ import annotations

import argparse
import sys
import json
import shutil
import time
from pathlib import Path

SHARD_BYTES = 5_000_000_000
SEED = 20261201

TRANSFORMER = dict(
    all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
    n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
    axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
)
TEXT_ENCODER = dict(
    architectures=["Qwen3ForCausalLM"], hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, intermediate_size=9728, hidden_act="silu", rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=40960,
    vocab_size=151936, tie_word_embeddings=True, attention_bias=False, torch_dtype="bfloat16",
)
VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2,
    norm_num_groups=32, act_fn="silu", mid_block_add_attention=True, use_quant_conv=False, use_post_quant_conv=False,
    scaling_factor=0.3611, shift_factor=0.1159, sample_size=1024, force_upcast=True,
)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)

# Every file this tool writes lies here (tools/owned_output.py refuses a directory holding a file it did not write
# in any of them, even with --force): exactly the files and folders of a real Z-Image checkpoint.
WRITES = ["model_index.json", "transformer/", "text_encoder/", "vae/", "scheduler/", "tokenizer/"]


def random_weight(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """A bf16 tensor of `shape` whose values keep a forward finite."""
    import torch

    if len(shape) == 1:
        if "norm" in name and name.endswith("weight"):
            return torch.ones(shape, dtype=torch.bfloat16)
        return torch.zeros(shape, dtype=torch.bfloat16)
    fan_in = 1
    for s in shape[1:]:
        fan_in *= s
    out = torch.empty(shape, dtype=torch.float32).normal_(0.0, 1.0 / fan_in**0.5, generator=gen)
    return out.to(torch.bfloat16)


def write_shards(model, owned, component: str, stem: str, gen: torch.Generator) -> dict:
    """The model's keys and shapes (from its meta tensors) as bf16 shards of at most SHARD_BYTES."""
    import torch
    from safetensors.torch import save_file

    dir_ = owned.root / component
    entries = [(name, t.shape) for name, t in model.state_dict().items()]
    shards: list[list[tuple[str, torch.Size]]] = [[]]
    size = 0
    for name, shape in entries:
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    total = sum(2 * torch.Size(shape).numel() for _, shape in entries)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        target = owned.claim(f"{component}/{file}")
        tensors = {name: random_weight(name, shape, gen) for name, shape in shard}
        save_file(tensors, str(target), metadata={"format": "pt"})
        del tensors
        weight_map.update({name: file for name, _ in shard})
        print(f"  {dir_.name}/{file}: {len(shard)} tensors", flush=True)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        owned.claim(f"{component}/{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"tensors": len(entries), "bytes": total, "shards": len(shards)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--force", action="store_true",
                    help="write into a non-empty directory this tool did not make, beside its files: none is ever "
                         "written over or removed, and a directory holding files where this tool writes (a real "
                         "checkpoint: model_index.json, transformer/, text_encoder/, vae/, scheduler/, tokenizer/) "
                         "is refused even then")
    args = ap.parse_args()
    out: Path = args.out
    # Never writes over or removes what it did not write: a foreign non-empty directory is refused unless --force,
    # one holding a file where this tool writes (a real checkpoint) is refused even then, and a rewrite removes only
    # the files the last run listed (tools/owned_output.py).
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from owned_output import OwnedOutput

    owned = OwnedOutput(out, "tools/make_real_size.py", args.force)
    owned.prepare(writes=WRITES)
    # torch is imported only once the directory is accepted, so the refusal needs nothing installed.
    import torch

    gen = torch.Generator().manual_seed(SEED)
    torch.set_num_threads(2)
    started = time.time()

    import diffusers
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    summary = {}
    with torch.device("meta"):
        transformer = ZImageTransformer2DModel(**TRANSFORMER)
        te_config = Qwen3Config(**TEXT_ENCODER)
        text_encoder = Qwen3Model(te_config)
        vae = AutoencoderKL(**VAE)

    # Each config is claimed before the library writes it (prepare already refused any foreign file there).
    (out / "transformer").mkdir(exist_ok=True)
    owned.claim("transformer/config.json")
    transformer.save_config(str(out / "transformer"))
    summary["transformer"] = write_shards(transformer, owned, "transformer", "diffusion_pytorch_model", gen)

    (out / "text_encoder").mkdir(exist_ok=True)
    owned.claim("text_encoder/config.json")
    te_config.save_pretrained(str(out / "text_encoder"))
    summary["text_encoder"] = write_shards(text_encoder, owned, "text_encoder", "model", gen)

    (out / "vae").mkdir(exist_ok=True)
    owned.claim("vae/config.json")
    vae.save_config(str(out / "vae"))
    summary["vae"] = write_shards(vae, owned, "vae", "diffusion_pytorch_model", gen)

    owned.claim("scheduler/scheduler_config.json")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(str(out / "scheduler"))
    tiny = Path(__file__).resolve().parent.parent / "crates/pipeline-zimage/tests/fixtures/tiny-z-image-turbo"
    for source in sorted((tiny / "tokenizer").rglob("*")):
        if source.is_file():
            target = owned.claim(Path("tokenizer") / source.relative_to(tiny / "tokenizer"))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    index = {
        "_class_name": "ZImagePipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3Model"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "ZImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    owned.claim("model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    owned.finish()
    summary["versions"] = {"torch": torch.__version__, "diffusers": diffusers.__version__,
                           "transformers": transformers.__version__}
    summary["seconds"] = round(time.time() - started, 1)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
