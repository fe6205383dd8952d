#!/usr/bin/env python3
"""Build tiny LoRA files for the tiny Z-Image-Turbo checkpoint, in the layouts users download, each with
diffusers' image from given latents: what `pipeline-zimage`'s `tests/lora.rs` reads.

Usage (from the repository root, inside the gitignored venv of tools/requirements-fixtures.txt, which lists peft):

    .venv/bin/python tools/make_lora_fixtures.py --fixtures crates/pipeline-zimage/tests/fixtures

What it writes:

* `lora/peft.safetensors`: a transformer LoRA made with peft (`LoraConfig(r=4, lora_alpha=8)` on every attention
  and feed-forward linear of every block list) and saved by diffusers' `ZImagePipeline.save_lora_weights`, the
  diffusers/PEFT layout: `transformer.<module>.lora_A.weight` `[r, in]`, `.lora_B.weight` `[out, r]`, and the
  adapter's config as the safetensors metadata `lora_adapter_metadata` (which carries `lora_alpha`).
* `lora/kohya.safetensors`: a second, rank-2 transformer LoRA in the Kohya / sd-scripts layout the Z-Image
  community publishes for the original module tree: `lora_unet_<module with _>.lora_down.weight`,
  `.lora_up.weight`, a scalar `.alpha` per module, the attention's query, key and value as one fused `qkv` module
  and its output as `out`. diffusers converts it on load (`_convert_non_diffusers_z_image_lora_to_diffusers`).
* `lora/with-text-encoder.safetensors`: a LoRA in the PEFT layout with both a `transformer.` and a
  `text_encoder.` part (the Qwen3 text encoder's attention and MLP linears, `r=2`, `lora_alpha=2`).
* `lora/comfyui.safetensors`: the factors of `kohya.safetensors`, keyed the way ComfyUI's own trainer saves a
  Z-Image LoRA (`TrainLoraNode` then `SaveLoRA`, with `lora_dtype` fp32): the model's own module names under
  `diffusion_model.` (`layers.0.attention.qkv`, `layers.0.attention.out`, `layers.0.feed_forward.w1`),
  `.lora_up.weight`, `.lora_down.weight` and a scalar `.alpha` per module. Same update, so its expected image is
  the `kohya` golden (diffusers 0.42.1 drops a dotted `qkv` and reads no `out.lora_A`, so it cannot be the
  oracle for this layout).
* `lora/original-tree.safetensors`: the factors of `peft.safetensors` on the original module tree without a
  prefix (`layers.0.attention.qkv.lora_A.weight`, `.lora_B.weight`, `.alpha`): `to_out.0` as `out`, and the
  query, key and value as one `qkv` module of rank 3r whose down factor stacks theirs and whose up factor is
  block diagonal (exactly their three updates), alpha scaled so alpha / rank is unchanged. Expected image: the
  `peft` golden.

Goldens (`golden/lora.safetensors`: `latents`, and one image per case; `golden/lora.json`: each case's files and
scales): diffusers' `load_lora_weights` plus `set_adapters` for the transformer parts; diffusers' Z-Image loader
reads only the transformer, so the text encoder part is applied with peft's own `inject_adapter_in_model` and
`set_peft_model_state_dict` and scaled with peft's `set_adapter_scale`-equivalent (`scaling` per layer). Every
random number comes from one seeded CPU generator.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SEED = 20261202
PROMPT = "a red fox in the snow"
STEPS = 2
SIZE = 64
MAX_SEQ = 32
TRANSFORMER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from owned_output import OwnedOutput  # noqa: E402


def random_lora(model, config, gen: torch.Generator) -> dict:
    """Injects a peft adapter into `model` and draws its factors (peft starts lora_B at zero, which would make
    the LoRA a no-op); returns the adapter's state dict without the adapter name."""
    from peft import get_peft_model_state_dict, inject_adapter_in_model

    inject_adapter_in_model(config, model, adapter_name="fixture")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                fan_in = p.shape[1]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
    state = get_peft_model_state_dict(model, adapter_name="fixture")
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.delete_adapter("fixture")
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def to_kohya(state: dict, alpha: float) -> dict:
    """A PEFT-layout transformer state dict in the Kohya layout of the original module tree: fused qkv (the three
    down matrices stacked is not a LoRA of the fused module; Kohya trains one down matrix, so this LoRA is built
    with the query, key and value sharing theirs), `out` for `to_out.0`, underscores, alphas."""
    out = {}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    done = set()
    for module in modules:
        if module in done:
            continue
        a, b = state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"]
        rank = a.shape[0]
        if module.endswith(".to_q"):
            block = module[: -len(".to_q")]
            ups = [state[f"{block}.{p}.lora_B.weight"] for p in ("to_q", "to_k", "to_v")]
            name = f"{block}.qkv"
            done.update(f"{block}.{p}" for p in ("to_q", "to_k", "to_v"))
            a, b = a, torch.cat(ups, 0)
        elif module.endswith(".to_k") or module.endswith(".to_v"):
            continue
        elif module.endswith(".to_out.0"):
            name = module[: -len(".to_out.0")] + ".out"
        else:
            name = module
        key = "lora_unet_" + name.replace(".", "_")
        out[f"{key}.lora_down.weight"] = a.contiguous()
        out[f"{key}.lora_up.weight"] = b.contiguous()
        out[f"{key}.alpha"] = torch.tensor(alpha)
        assert a.shape[0] == rank
    return out



def to_comfyui(state: dict, alpha: float) -> dict:
    """The Kohya-layout state dict `to_kohya` makes, with ComfyUI's trainer's key names: dotted module names of the
    original tree under `diffusion_model.` instead of `lora_unet_` and underscores; the factors and alphas are
    the same tensors."""
    out = {}
    for key, value in to_kohya(state, alpha).items():
        module, role = key.split(".", 1)
        dotted = original_tree_name(module.removeprefix("lora_unet_"))
        out[f"diffusion_model.{dotted}.{role}"] = value
    return out


def original_tree_name(underscored: str) -> str:
    """`layers_0_attention_qkv` -> `layers.0.attention.qkv`: the dots of a Kohya module name back, for the modules
    the fixtures target (each name part of the original tree with an underscore is listed)."""
    joined = {"feed_forward", "noise_refiner", "context_refiner"}
    parts = underscored.split("_")
    names = []
    i = 0
    while i < len(parts):
        pair = "_".join(parts[i : i + 2])
        if pair in joined:
            names.append(pair)
            i += 2
        else:
            names.append(parts[i])
            i += 1
    return ".".join(names)


def to_original_tree(state: dict, alpha: float) -> dict:
    """A PEFT-layout transformer state dict on the original module tree, no prefix, diffusers' `lora_A`/`lora_B`
    names and an `.alpha` per module: `to_out.0` as `out`; `to_q`, `to_k` and `to_v` as one `qkv` module whose
    down factor stacks their three (rank 3r) and whose up factor is block diagonal, which is exactly the sum of
    their updates; its alpha is 3 alpha so that alpha / rank stays alpha / r."""
    out = {}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    for module in modules:
        a, b = state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"]
        module_alpha = alpha
        if module.endswith(".to_k") or module.endswith(".to_v"):
            continue
        if module.endswith(".to_q"):
            block = module[: -len(".to_q")]
            downs = [state[f"{block}.{p}.lora_A.weight"] for p in ("to_q", "to_k", "to_v")]
            ups = [state[f"{block}.{p}.lora_B.weight"] for p in ("to_q", "to_k", "to_v")]
            a, b = torch.cat(downs, 0), torch.block_diag(*ups)
            module_alpha = alpha * len(downs)
            name = f"{block}.qkv"
        elif module.endswith(".to_out.0"):
            name = module[: -len(".to_out.0")] + ".out"
        else:
            name = module
        out[f"{name}.lora_A.weight"] = a.contiguous()
        out[f"{name}.lora_B.weight"] = b.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(module_alpha))
    return out

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", required=True, type=Path)
    ap.add_argument("--force", action="store_true",
                    help="write into a non-empty lora directory this tool did not make (its files are kept)")
    args = ap.parse_args()
    fixtures: Path = args.fixtures
    lora_dir = fixtures / "lora"
    golden = fixtures / "golden"
    owned = [OwnedOutput(d, "tools/make_lora_fixtures.py", args.force, tag="lora") for d in (lora_dir, golden)]
    # The goldens directory is shared with the other generators: only this tool's earlier files are removed.
    for directory in owned:
        directory.prepare()

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(SEED)

    import diffusers
    import peft
    from diffusers import ZImagePipeline
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    ckpt = fixtures / "tiny-z-image-turbo"

    def fresh():
        pipe = ZImagePipeline.from_pretrained(str(ckpt), torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ---- the files -------------------------------------------------------------------------------------------
    pipe = fresh()
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=TRANSFORMER_TARGETS, init_lora_weights=False)
    peft_state = random_lora(pipe.transformer, peft_config, gen)
    metadata = peft_config.to_dict()
    # Sets (target_modules) sorted, so the file is the same bytes on every run.
    metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
    ZImagePipeline.save_lora_weights(str(lora_dir), transformer_lora_layers=peft_state,
                                     transformer_lora_adapter_metadata=metadata, weight_name="peft.safetensors")

    pipe = fresh()
    kohya_config = LoraConfig(r=2, lora_alpha=2, target_modules=TRANSFORMER_TARGETS, init_lora_weights=False)
    kohya_peft = random_lora(pipe.transformer, kohya_config, gen)
    # Kohya's fused qkv has one down matrix: the query's, shared by the key and the value.
    for key in list(kohya_peft):
        for proj in ("to_k", "to_v"):
            if f".{proj}.lora_A" in key:
                kohya_peft[key] = kohya_peft[key.replace(f".{proj}.", ".to_q.")].clone()
    kohya_alpha = 3.0
    save_file(to_kohya(kohya_peft, kohya_alpha), str(lora_dir / "kohya.safetensors"))
    # The same two LoRAs in the layouts of ComfyUI and of the original module tree (no new golden: the same
    # updates give the `kohya` and `peft` images).
    save_file(to_comfyui(kohya_peft, kohya_alpha), str(lora_dir / "comfyui.safetensors"))
    save_file(to_original_tree(peft_state, peft_config.lora_alpha), str(lora_dir / "original-tree.safetensors"))

    pipe = fresh()
    te_transformer = random_lora(pipe.transformer, LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "w2"],
                                                              init_lora_weights=False), gen)
    te_config = LoraConfig(r=2, lora_alpha=2, target_modules=TEXT_TARGETS, init_lora_weights=False)
    te_state = random_lora(pipe.text_encoder, te_config, gen)
    combined = {f"transformer.{k}": v for k, v in te_transformer.items()}
    combined.update({f"text_encoder.{k}": v for k, v in te_state.items()})
    save_file(combined, str(lora_dir / "with-text-encoder.safetensors"))

    # ---- the goldens -----------------------------------------------------------------------------------------
    latents = torch.randn((1, 16, SIZE // 8, SIZE // 8), generator=gen, dtype=torch.float32)

    def image(pipe) -> torch.Tensor:
        with torch.no_grad():
            out = pipe(prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=0.0,
                       latents=latents.clone(), max_sequence_length=MAX_SEQ, output_type="pt")
        return out.images.to(torch.float32).contiguous()

    cases = {}
    tensors = {"latents": latents.contiguous(), "base": image(fresh())}

    def case(name: str, loras: list[tuple[str, float]], text_encoder: tuple[str, float] | None = None):
        pipe = fresh()
        names = []
        for i, (file, _) in enumerate(loras):
            pipe.load_lora_weights(str(lora_dir), weight_name=file, adapter_name=f"a{i}")
            names.append(f"a{i}")
        pipe.set_adapters(names, adapter_weights=[scale for _, scale in loras])
        if text_encoder is not None:
            from peft import inject_adapter_in_model, set_peft_model_state_dict
            from peft.tuners.lora import LoraLayer

            file, scale = text_encoder
            state = load_file(str(lora_dir / file))
            te = {k.removeprefix("text_encoder."): v for k, v in state.items() if k.startswith("text_encoder.")}
            inject_adapter_in_model(te_config, pipe.text_encoder, adapter_name="te")
            set_peft_model_state_dict(pipe.text_encoder, te, adapter_name="te")
            for module in pipe.text_encoder.modules():
                if isinstance(module, LoraLayer):
                    module.set_scale("te", scale)
        tensors[name] = image(pipe)
        cases[name] = {"loras": [{"file": f, "scale": s} for f, s in loras],
                       "max_abs_difference_from_base": float((tensors[name] - tensors["base"]).abs().max())}

    case("peft", [("peft.safetensors", 0.75)])
    case("kohya", [("kohya.safetensors", 1.0)])
    case("both", [("peft.safetensors", 0.75), ("kohya.safetensors", 1.0)])
    case("with_text_encoder", [("with-text-encoder.safetensors", 0.5)], ("with-text-encoder.safetensors", 0.5))

    save_file(tensors, str(golden / "lora.safetensors"))
    facts = {"prompt": PROMPT, "steps": STEPS, "size": SIZE, "max_sequence_length": MAX_SEQ, "seed": SEED,
             "kohya_alpha": kohya_alpha, "diffusers": diffusers.__version__, "peft": peft.__version__,
             "torch": torch.__version__, "cases": cases}
    (golden / "lora.json").write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
    for directory in owned:
        directory.finish()
    for name, facts_ in cases.items():
        print(f"{name}: max |lora - base| = {facts_['max_abs_difference_from_base']:.3e}")


if __name__ == "__main__":
    main()
