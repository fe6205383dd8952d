#!/usr/bin/env python3
"""Build checkpoint variants of the tiny Z-Image-Turbo checkpoint, as other library versions and settings save
them, each with diffusers' output from given latents: what `pipeline-zimage`'s `tests/variants.rs` reads.

Usage (from the repository root, inside the gitignored venv of tools/requirements-fixtures.txt):

    .venv/bin/python tools/make_variant_fixtures.py --fixtures crates/pipeline-zimage/tests/fixtures

Each variant is an overlay: the files that differ from `tiny-z-image-turbo/`, under `variants/<name>/`. A
variant's checkpoint is the tiny checkpoint with its overlay copied over it (the tests and this script assemble it
the same way), so only what differs is committed. Variants:

* `vae-2-levels`, `vae-3-levels`: a VAE with 2 or 3 levels (`block_out_channels` of that length), so
  `vae_scale_factor` = 2^(levels - 1) = 2 or 4 instead of 8: the latent size and the size check follow it.
* `generic-tokenizer`: the pipeline saved by transformers 5 with the tokenizer held as its generic fast class
  (`TokenizersBackend` in `model_index.json`), which also writes the chat template as `chat_template.jinja`.
* `bf16`: every component saved in bfloat16 (as the real checkpoint is), and diffusers run in bfloat16; its
  entry in `variants.json` also says how far that run lies from the same weights run in float32.
* `lm-head`: the text encoder saved as a causal LM (`Qwen3ForCausalLM`: `model.` prefixes and an `lm_head`),
  which diffusers loads as `Qwen3Model`, ignoring the head.

Goldens go to `golden/variant_<name>.safetensors` (`latents`, the initial noise; `image`, diffusers' output in
float32) with their options in `golden/variants.json`. Every random number comes from one seeded CPU generator.
"""

from __future__ import annotations

import argparse
import sys
import json
import shutil
import tempfile
from pathlib import Path

import torch

SEED = 20261201
PROMPT = "a red fox in the snow"
STEPS = 2
SIZE = 64
MAX_SEQ = 32


def assemble(fixtures: Path, name: str, into: Path) -> Path:
    """The tiny checkpoint with the overlay of variant `name` copied over it, in `into`."""
    ckpt = into / name
    if ckpt.exists():
        shutil.rmtree(ckpt)
    shutil.copytree(fixtures / "tiny-z-image-turbo", ckpt)
    overlay = fixtures / "variants" / name
    # A component the overlay replaces is replaced whole (a sharded text encoder becomes one file, say).
    for component in sorted(p for p in overlay.iterdir() if p.is_dir()):
        shutil.rmtree(ckpt / component.name, ignore_errors=True)
    for path in sorted(overlay.rglob("*")):
        if path.is_file():
            target = ckpt / path.relative_to(overlay)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)
    return ckpt


# Each directory this tool writes is an OwnedOutput (tools/owned_output.py): refused when it holds files no
# generator listed (unless --force), and only the files this tool listed are ever removed.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from owned_output import OwnedOutput  # noqa: E402

FORCE = False
OWNED: list = []


def fresh_overlay(fixtures: Path, name: str) -> Path:
    """The overlay directory of variant `name`, with this tool's earlier files removed."""
    overlay = fixtures / "variants" / name
    owned = OwnedOutput(overlay, "tools/make_variant_fixtures.py", FORCE, tag="variants")
    owned.prepare()
    OWNED.append(owned)
    return overlay


def replace_component(overlay: Path, component: str, saved: Path) -> None:
    """Puts the directory `saved` (a save_pretrained output) in the overlay as `component`."""
    target = overlay / component
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(saved, target)


def randomize(module, gen: torch.Generator) -> None:
    """Random weights of unit-variance outputs, as make_fixtures.py draws them."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight") or ".norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * r)
            elif p.ndim == 1:
                p.copy_(0.1 * r)
            else:
                fan_in = 1
                for s in p.shape[1:]:
                    fan_in *= s
                p.copy_(r / fan_in**0.5)


def vae_variant(fixtures: Path, levels: int, gen: torch.Generator, work: Path) -> Path:
    from diffusers import AutoencoderKL

    base = json.loads((fixtures / "tiny-z-image-turbo" / "vae" / "config.json").read_text())
    channels = [16, 32, 32, 32][:levels]
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * levels,
        up_block_types=["UpDecoderBlock2D"] * levels, block_out_channels=channels,
        layers_per_block=base["layers_per_block"], act_fn="silu", latent_channels=16,
        norm_num_groups=base["norm_num_groups"], sample_size=SIZE, scaling_factor=base["scaling_factor"],
        shift_factor=base["shift_factor"], use_quant_conv=False, use_post_quant_conv=False,
        mid_block_add_attention=True, force_upcast=True,
    ).eval()
    randomize(vae, gen)
    saved = work / f"vae-{levels}"
    vae.save_pretrained(str(saved), safe_serialization=True)
    overlay = fresh_overlay(fixtures, f"vae-{levels}-levels")
    replace_component(overlay, "vae", saved)
    return overlay


def generic_tokenizer_variant(fixtures: Path, work: Path) -> Path:
    import transformers
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(fixtures / "tiny-z-image-turbo"), torch_dtype=torch.float32)
    tokenizer = transformers.TokenizersBackend.from_pretrained(str(fixtures / "tiny-z-image-turbo" / "tokenizer"))
    pipe.tokenizer = tokenizer
    pipe.register_modules(tokenizer=tokenizer)
    saved = work / "generic"
    pipe.save_pretrained(str(saved), safe_serialization=True)
    index = json.loads((saved / "model_index.json").read_text())
    assert index["tokenizer"][1] == "TokenizersBackend", index["tokenizer"]
    overlay = fresh_overlay(fixtures, "generic-tokenizer")
    shutil.copy(saved / "model_index.json", overlay / "model_index.json")
    replace_component(overlay, "tokenizer", saved / "tokenizer")
    return overlay


def bf16_variant(fixtures: Path, work: Path) -> Path:
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(fixtures / "tiny-z-image-turbo"), torch_dtype=torch.bfloat16)
    saved = work / "bf16"
    pipe.save_pretrained(str(saved), safe_serialization=True)
    overlay = fresh_overlay(fixtures, "bf16")
    for component in ("text_encoder", "transformer", "vae"):
        replace_component(overlay, component, saved / component)
    return overlay


def lm_head_variant(fixtures: Path, gen: torch.Generator, work: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    te_dir = fixtures / "tiny-z-image-turbo" / "text_encoder"
    base = Qwen3Model.from_pretrained(str(te_dir), torch_dtype=torch.float32)
    config = Qwen3Config.from_pretrained(str(te_dir))
    config.tie_word_embeddings = False
    config.architectures = ["Qwen3ForCausalLM"]
    causal = Qwen3ForCausalLM(config).eval()
    causal.model.load_state_dict(base.state_dict())
    with torch.no_grad():
        causal.lm_head.weight.copy_(torch.randn(causal.lm_head.weight.shape, generator=gen))
    saved = work / "causal"
    causal.save_pretrained(str(saved), safe_serialization=True)
    overlay = fresh_overlay(fixtures, "lm-head")
    replace_component(overlay, "text_encoder", saved)
    return overlay


def golden(fixtures: Path, name: str, dtype: torch.dtype, gen: torch.Generator, work: Path) -> dict:
    from diffusers import ZImagePipeline
    from safetensors.torch import save_file

    ckpt = assemble(fixtures, name, work / "assembled")
    pipe = ZImagePipeline.from_pretrained(str(ckpt), torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    scale = pipe.vae_scale_factor
    side = 2 * (SIZE // (scale * 2))
    latents = torch.randn((1, 16, side, side), generator=gen, dtype=torch.float32)
    out = pipe(prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=0.0,
               latents=latents.to(dtype), max_sequence_length=MAX_SEQ, output_type="pt")
    image = out.images.to(torch.float32).contiguous()
    save_file({"latents": latents.contiguous(), "image": image}, str(fixtures / "golden" / f"variant_{name}.safetensors"))
    facts = {"vae_scale_factor": scale, "latent_side": side, "dtype": str(dtype).replace("torch.", ""),
             "tokenizer_class": type(pipe.tokenizer).__name__}
    if dtype != torch.float32:
        # How far diffusers' own low-precision run lies from the same weights run in float32: the size of the
        # rounding a second low-precision implementation is held to.
        exact = ZImagePipeline.from_pretrained(str(ckpt), torch_dtype=torch.float32)
        exact.set_progress_bar_config(disable=True)
        reference = exact(prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=0.0,
                          latents=latents, max_sequence_length=MAX_SEQ, output_type="pt").images
        facts["max_abs_difference_from_float32"] = float((image - reference.to(torch.float32)).abs().max())
    return facts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", required=True, type=Path)
    ap.add_argument("--force", action="store_true",
                    help="write into non-empty directories this tool did not make (their files are kept)")
    args = ap.parse_args()
    fixtures: Path = args.fixtures
    global FORCE
    FORCE = args.force
    golden_dir = OwnedOutput(fixtures / "golden", "tools/make_variant_fixtures.py", FORCE, tag="variants")
    golden_dir.prepare()
    OWNED.append(golden_dir)
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(SEED)

    import diffusers
    import transformers

    meta = {
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                     "transformers": transformers.__version__, "seed": SEED},
        "options": {"prompt": PROMPT, "steps": STEPS, "height": SIZE, "width": SIZE, "guidance": 0.0,
                    "max_sequence_length": MAX_SEQ},
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        vae_variant(fixtures, 2, gen, work)
        vae_variant(fixtures, 3, gen, work)
        generic_tokenizer_variant(fixtures, work)
        bf16_variant(fixtures, work)
        lm_head_variant(fixtures, gen, work)
        for name, dtype in [("vae-2-levels", torch.float32), ("vae-3-levels", torch.float32),
                            ("generic-tokenizer", torch.float32), ("bf16", torch.bfloat16),
                            ("lm-head", torch.float32)]:
            meta["variants"][name] = golden(fixtures, name, dtype, gen, work)
    (fixtures / "golden" / "variants.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    for owned in OWNED:
        owned.finish()
    print(json.dumps(meta["variants"], indent=2))


if __name__ == "__main__":
    main()
